"""The memory a GPU attention kernel allocates inside itself: buffers that live only while the kernel runs,
beyond its inputs, its outputs and what it saves for the backward. No dispatcher sees them (they are
``at::empty`` calls inside the C++ entry point, or a cuDNN engine's workspace), so neither the meta-device
step nor a live-storage tracker on a CUDA step counts them; the CUDA caching allocator does. On the H200
(docs/gpu.md) they made the allocator's peak 1.124 of the modelled one at 65536 tokens and 1.185 at 131072.

One ``Call`` is one kernel call as the kernel sees it: under Ulysses SP (``ulysses_call``) every rank's
attention runs the whole sequence for ``heads / sp`` of the query heads. Each backend's formula below was
read from the kernel's own source, cited next to it; the bytes are what that source allocates for the
call's shape. ``plan.py`` adds the backward's workspace at the moment the attention backward runs
(``attention.py``), not to the step's peak: it is transient.

``for_config`` is the one call a GPU report needs: the workspace of a config's attention at a length.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

F32 = 4  # bytes of a float32 accumulator
I32 = 4
FA2, FA3 = "flash_attention_2", "flash_attention_3"
SDPA_FLASH, SDPA_EFFICIENT, SDPA_CUDNN, FLEX = "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex_attention"
TITLES = {FA2: "FlashAttention-2", FA3: "FlashAttention-3", SDPA_FLASH: "sdpa's flash backend (FlashAttention-2)",
          SDPA_EFFICIENT: "sdpa's memory-efficient backend", SDPA_CUDNN: "sdpa's cuDNN backend",
          FLEX: "flex attention"}


@dataclass(frozen=True)
class Call:
    """One attention kernel call: ``batch`` sequences of ``q_tokens`` queries against ``kv_tokens`` keys,
    ``heads`` query heads over ``kv_heads`` key/value heads (MHA: equal; GQA: a divisor; MQA: 1) of
    ``head_dim``, in ``dtype``."""

    batch: int
    q_tokens: int
    kv_tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("batch", "q_tokens", "kv_tokens", "heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"attention call: {name} must be a whole number, 1 or more (got {value!r})")
        if self.heads % self.kv_heads:
            raise ValueError(f"attention call: {self.kv_heads} key/value heads do not divide {self.heads} query heads")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def grouped(self) -> bool:
        return self.kv_heads != self.heads


@dataclass(frozen=True)
class Workspace:
    """What one call allocates inside its forward and its backward, with the backward's buffers named."""

    backend: str
    forward: int
    backward: int
    parts: Tuple[Tuple[str, int], ...] = ()  # the backward's buffers: (what, bytes)

    def describe(self) -> str:
        named = ", ".join(f"{what} {_gib(nbytes)}" for what, nbytes in self.parts if nbytes)
        return f"{TITLES.get(self.backend, self.backend)} backward, {_gib(self.backward)}" + (f" ({named})" if named else "")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**27 else f"{nbytes / 2**20:.1f} MiB"


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def _workspace(backend: str, forward: int, parts: Dict[str, int]) -> Workspace:
    return Workspace(backend, forward, sum(parts.values()), tuple(parts.items()))


def flash_attention_2(call: Call, varlen: bool = False) -> Workspace:
    """FlashAttention-2's backward, as ``flash_attn_func`` / ``flash_attn_varlen_func`` (transformers'
    flash_attention_2) and sdpa's flash backend run it.

    Read: Dao-AILab/flash-attention csrc/flash_attn/flash_api.cpp and PyTorch's copy,
    aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, ``mha_bwd`` and ``mha_varlen_bwd``:
    dq, dk, dv are the outputs (modelled); inside, ``softmax_d`` float32 [b, h, round(s_q, 128)];
    ``dq_accum`` float32 [b, round(s_q, 128), h, d_rounded] (d_rounded: d up to a multiple of 32 for
    d <= 128, else of 64; ``loop`` is always true, the non-deterministic path); the varlen entry sizes
    both by ``total_q + 128 * b`` rows instead. Under GQA/MQA ``dk_expanded`` and ``dv_expanded``
    [b, s_k, h, d] in the input dtype (every query head's key and value gradient), summed into dk and dv
    after the kernel. The forward (``mha_fwd``) allocates only its outputs and the saved log-sum-exp for
    a training step (no split-KV buffers at one query block per call's tile), so it adds none."""
    d_rounded = _up(call.head_dim, 32 if call.head_dim <= 128 else 64)
    rows = call.q_tokens * call.batch + 128 * call.batch if varlen else call.batch * _up(call.q_tokens, 128)
    parts = {"float32 dq accumulator": rows * call.heads * d_rounded * F32,
             "float32 softmax_d": rows * call.heads * F32}
    if call.grouped:
        parts["dk, dv expanded to every query head"] = 2 * call.batch * call.kv_tokens * call.heads * call.head_dim * call.itemsize
    return _workspace(FA2, 0, parts)


def sdpa_flash(call: Call) -> Workspace:
    """sdpa's flash backend: ``_scaled_dot_product_flash_attention`` calls PyTorch's copy of
    FlashAttention-2's ``mha_bwd`` (non-varlen), whose allocations ``flash_attention_2`` gives."""
    return dataclasses.replace(flash_attention_2(call), backend=SDPA_FLASH)


def flash_attention_3(call: Call) -> Workspace:
    """FlashAttention-3 (Hopper, sm90), ``flash_attn_interface``'s backward of a causal call.

    Read: Dao-AILab/flash-attention hopper/flash_api.cpp ``mha_bwd``: d_rounded = d up to 64, 96, 128, 192
    or 256; block sizes by it (sm90, causal: kBlockM 128 for d_rounded <= 64, else 64; kBlockN 128 for
    d_rounded <= 128, 96 to 192, else 80); ``softmax_d`` and ``softmax_lse_log2`` float32
    [b, h, round(s_q, kBlockM)]; ``dq_accum`` float32 [b, h, round(s_q, kBlockM) * d_rounded]; under
    GQA/MQA ``dk_accum`` and ``dv_accum`` float32 [b, h_k, round(s_k, kBlockN) * d_rounded] (accumulated
    per key/value head, not expanded); ``dq_semaphore`` int32 [ceil(s_q / kBlockM), b, h]. The forward adds
    none at training lengths."""
    d = call.head_dim
    if d > 256:
        raise ValueError(f"FlashAttention-3 takes head dims up to 256 (got {d})")
    d_rounded = next(r for r in (64, 96, 128, 192, 256) if d <= r)
    block_m = 128 if d_rounded <= 64 else 64
    block_n = 128 if d_rounded <= 128 else (96 if d_rounded <= 192 else 80)
    q_rows = call.batch * _up(call.q_tokens, block_m)
    parts = {"float32 dq accumulator": q_rows * call.heads * d_rounded * F32,
             "float32 softmax_d and lse_log2": 2 * q_rows * call.heads * F32,
             "dq semaphore": -(-call.q_tokens // block_m) * call.batch * call.heads * I32}
    if call.grouped:
        parts["float32 dk, dv accumulators"] = 2 * call.batch * call.kv_heads * _up(call.kv_tokens, block_n) * d_rounded * F32
    return _workspace(FA3, 0, parts)


def sdpa_efficient(call: Call) -> Workspace:
    """sdpa's memory-efficient backend (CUTLASS, from xformers), sm80 and later.

    Read: PyTorch aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernel_backward.h
    (``Params::workspace_size``): one buffer of b * h * align4(gq + gk + gv) floats; ``gq`` (needed: split
    keys are on from sm70, and a 16-bit output accumulates in float32) = ceil(s_q / kBlockSizeI) *
    ceil(d / kN) * sizeof(GradQTempStorage) / 4, a GradQTempStorage being 16 bytes of lock and counter
    plus a kBlockSizeI x kN float32 tile; ``gk``/``gv`` only where dK/dV do not stay in registers
    (kOutputInRF: a 16-bit dtype and kMaxK <= kBlockSizeI), num_splits_key * kBlockSizeJ *
    align(d, kBlockSizeI) floats. The kernel sizes (kBlockSizeI x kBlockSizeJ) are the sm80 dispatch's:
    64 x 128 for d <= 128 (kMaxK 128, the dQ tile's kN = kBlockSizeJ), 64 x 64 above (kMaxK 65536); the
    key splits' count is not modelled above d = 128 (one split assumed). The forward, for d > 128 with
    a 16-bit output, keeps a float32 output accumulator [b, s_q, h, d] (kernel_forward.h,
    ``kNeedsOutputAccumulatorBuffer``; not read, from the kernel's documented rule). GQA/MQA: transformers
    repeats key and value before a masked sdpa call, so the kernel sees equal heads; an unmasked grouped
    call (float32, which flash does not take) reads key and value at ``kv_head_id`` but writes the key and
    value gradients at ``head_id`` (``Params::advance_to_block``), so they are made for every query head
    and summed after (that sum, in attention_backward.cu, was not read): modelled as FlashAttention-2's
    expansion, [b, s_k, h, d] each in the input dtype."""
    d, half = call.head_dim, call.itemsize <= 2
    block_i, block_j = (64, 128) if d <= 128 else (64, 64)
    max_k = 128 if d <= 128 else 65536
    tile = 16 + block_i * block_j * F32
    gq = -(-call.q_tokens // block_i) * -(-d // block_j) * tile // F32
    in_registers = half and max_k <= block_i
    gkv = 0 if in_registers or not half else 2 * block_j * _up(d, block_i)
    per_head = _up(gq + gkv, 4) * F32
    parts = {"float32 dq accumulator tiles": call.batch * call.heads * _up(gq, 4) * F32,
             "float32 dk, dv tiles": call.batch * call.heads * (per_head - _up(gq, 4) * F32)}
    if call.grouped:
        parts["dk, dv expanded to every query head"] = 2 * call.batch * call.kv_tokens * call.heads * d * call.itemsize
    forward = call.batch * call.q_tokens * call.heads * d * F32 if half and d > 128 else 0
    return _workspace(SDPA_EFFICIENT, forward, parts)


def sdpa_cudnn(call: Call) -> Workspace:
    """sdpa's cuDNN backend (cuDNN 9 frontend graph).

    Read: NVIDIA/cudnn-frontend include/cudnn_frontend/node/scaled_dot_product_flash_attention.h,
    ``SDPABackwardNode``/``CompositeSDPABackwardNode``: the frontend's own workspace is ``dQ_accum``
    float32 [b, h_q, s_q, d] (not rounded; from cuDNN 9.0 the dP-workspace variant is off unless
    deterministic or with a bias gradient) and ``softmax_sum`` float32 [b, h_q, s_q]; under GQA the
    full-head dK/dV are virtual (in-graph) for a dense layout, not allocated. The cuDNN engine's own
    workspace (``get_workspace_size``) is not in the source read and is not modelled."""
    rows = call.batch * call.q_tokens * call.heads
    return _workspace(SDPA_CUDNN, 0, {"float32 dq accumulator": rows * call.head_dim * F32,
                                      "float32 softmax sum": rows * F32})


def flex_attention(call: Call) -> Workspace:
    """Flex attention's backward as inductor lowers it.

    Read: PyTorch torch/_inductor/kernel/flex/flex_attention.py (``flex_attention_backward``): ``delta``
    = sum(out * grad_out, -1) float32 [b, h_q, s_q] made before the kernel; grad_query written directly;
    grad_key/grad_value [b, h_kv, s_k, d] (the outputs; a broadcast copy only where the query and key
    batches differ), GQA handled inside the kernel by GQA_SHARED_HEADS, no expansion. The forward writes
    its output and log-sum-exp (saved) and adds none."""
    return _workspace(FLEX, 0, {"float32 delta": call.batch * call.heads * call.q_tokens * F32})


BACKENDS: Dict[str, Callable[[Call], Workspace]] = {
    FA2: flash_attention_2, FA3: flash_attention_3, SDPA_FLASH: sdpa_flash, SDPA_EFFICIENT: sdpa_efficient,
    SDPA_CUDNN: sdpa_cudnn, FLEX: flex_attention}


def workspace(backend: str, call: Call) -> Workspace:
    """``backend``'s workspace for ``call`` (a ValueError naming the backends for an unknown one)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention kernel {backend!r} has no workspace model; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[backend](call)


def gpu_kernel(choice: str) -> Optional[str]:
    """The kernel a CUDA step runs for the planner's attention ``choice`` (``attention.CHOICES``): sdpa's
    flash backend for sdpa (its masked calls go to the memory-efficient one: ``kernel_for_call``),
    FlashAttention-2 for flash_attention_2, none for eager (its ops are all dispatched and modelled). sdpa's flash backend, not
    cuDNN, is assumed: on the H200 the allocator's excess (about 24 KiB a token at Llama-3.1-8B's heads)
    exceeds all cuDNN's documented workspace (16.1 KiB a token) and fits FlashAttention-2's (32.1)."""
    if choice == "sdpa":
        return SDPA_FLASH
    if choice in ("flash_attention_2", FA2):
        return FA2
    return None


def kernel_for_call(kernel: str, call: Call, masked: bool) -> str:
    """The kernel that runs ``call`` where ``kernel`` is assumed for the step: sdpa sends a masked call, and
    one its flash backend cannot take (float32: flash takes only 16-bit inputs, sdp_utils.cpp's
    ``check_dtypes_flash_attention``), to the memory-efficient backend."""
    if kernel == SDPA_FLASH and (masked or call.itemsize > 2):
        return SDPA_EFFICIENT
    return SDPA_EFFICIENT if masked else kernel


def ulysses_call(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, sp: int = 1,
                 dtype: torch.dtype = torch.bfloat16) -> Call:
    """The call each rank's attention makes under Ulysses SP of ``sp`` ranks: the whole sequence, ``heads /
    sp`` query heads and ``kv_heads / sp`` key/value heads, or one where the ranks outnumber them (DeepSpeed
    repeats each key/value head ``sp / kv_heads`` times)."""
    if heads % sp:
        raise ValueError(f"Ulysses over {sp} ranks needs the {heads} query heads divisible by {sp}")
    return Call(batch, seq, seq, heads // sp, max(kv_heads // sp, 1), head_dim, dtype)


def for_config(config, seq: int, batch: int = 1, sp: int = 1, dtype: torch.dtype = torch.bfloat16,
               attention: str = "sdpa", backend: Optional[str] = None, tp: int = 1) -> Optional[Workspace]:
    """The workspace of one attention call of ``config`` (a transformers config) at ``seq`` tokens, on one
    rank of Ulysses SP over ``sp`` or of tensor parallelism over ``tp`` (each divides the heads the same
    way, the call keeps the whole sequence): ``backend`` where given, else the kernel a CUDA step runs for
    ``attention``'s unmasked calls (``gpu_kernel``, ``kernel_for_call``). None where the attention runs no
    kernel of its own (eager). The one function a comparison against a real CUDA step needs."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    call = ulysses_call(batch, seq, heads, kv_heads, head_dim, sp * tp, dtype)
    if backend is None:
        assumed = gpu_kernel(attention)
        if assumed is None:
            return None
        backend = kernel_for_call(assumed, call, masked=False)
    return workspace(backend, call)
