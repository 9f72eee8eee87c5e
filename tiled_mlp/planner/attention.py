"""The attention the planner models: the one Hugging Face runs for the model (``--attention``; by default
what transformers itself picks for the config), with the masks transformers builds for it.

``sdpa``: transformers' own ``sdpa_attention_forward`` and mask construction (``sdpa_mask``). A
full-attention layer gets no mask (SDPA's ``is_causal``) and runs a fused kernel over the grouped key and
value heads. A sliding-window layer, once the sequence reaches the window, gets a boolean
``[batch, 1, tokens, tokens]`` mask, built once per forward for all the sliding layers; each layer's
SDPA call turns it into a mask of the query's dtype, which the fused kernel keeps for its backward,
and transformers repeats the key and value heads to every query head (SDPA cannot group them under a
mask). On the meta device SDPA would take its math path (``[batch, heads, tokens, tokens]`` scores); the
kernel a device takes instead is called here by name: aten's flash attention for CPU, with the mask
converted as SDPA converts it. That is the kernel a CPU step runs, byte for byte
(``tests/planner/test_planner_attention.py``). On a GPU (not run here: read from torch's kernel selection) the
unmasked calls take FlashAttention and the masked ones the memory-efficient kernel, which keeps the same
mask, query, key, value and output for its backward, its log-sum-exp rounded up to 32 tokens.

``eager``: transformers' own eager attention and masks, which run on the meta device as they are: a
float ``[batch, 1, tokens, tokens]`` additive mask per layer kind, built once per forward, and per layer
the ``[batch, heads, tokens, tokens]`` scores, their float32 softmax and its cast back.

``flash_attention_2``: no mask (transformers builds none without padding) and a flash kernel: aten's
CPU flash attention, which saves the query, key, value, output and a float32 log-sum-exp per head and
token, the tensors FlashAttention-2 saves on a GPU. Softcapping and sliding windows change the numbers,
not the memory, so they are left out. Registered with transformers under a name of its own, which also
skips transformers' mask construction.

Transformers checks each step's position ids for packed sequences by reading their values
(``find_packed_sequence_indices``). A meta tensor has none: while a modelled step runs
(``positions_read``), that read gets the answer the planner's positions give (one sequence a row, as
``step.py`` makes them), after the check's own ops have run for their allocations.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional, Tuple

import torch

NAME = "tiled_mlp_planner_causal"  # the flash model
SDPA_NAME = "tiled_mlp_planner_sdpa"  # transformers' sdpa, with the kernel a device takes on the meta device
SDPA, FLASH, EAGER = "sdpa", "flash_attention_2", "eager"
CHOICES = (SDPA, FLASH, EAGER)


def causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = _flash(query, key, value, 0.0, True, None, scaling)
    return out.transpose(1, 2).contiguous(), None


# The GPU kernel whose own workspace each unmasked fused call on the meta device adds (``gpu_workspace``);
# None: none, a CPU step's.
_KERNEL: Optional[str] = None


@contextlib.contextmanager
def gpu_workspace(kernel: Optional[str]) -> Iterator[None]:
    """While a modelled step runs: every fused attention call on the meta device adds the memory the GPU
    ``kernel`` (``attention_workspace.BACKENDS``) allocates inside itself, a masked sdpa call that of sdpa's
    memory-efficient kernel; None adds none (a CPU step, which allocates nothing beyond its tensors)."""
    global _KERNEL
    previous, _KERNEL = _KERNEL, kernel
    try:
        yield
    finally:
        _KERNEL = previous


def _flash(query, key, value, dropout_p, is_causal, attn_mask, scale) -> torch.Tensor:
    """aten's CPU flash attention over ``query``, ``key``, ``value`` ([batch, heads, tokens, head_dim]): as it
    is, or on the meta device under ``gpu_workspace`` with the GPU kernel's workspace (``_WithWorkspace``)."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if _KERNEL is None or query.device.type != "meta":
        return kernel(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    from .attention_workspace import Call, kernel_for_call, workspace

    call = Call(query.shape[0], query.shape[2], key.shape[2], query.shape[1], key.shape[1], query.shape[3],
                query.dtype)
    held = workspace(kernel_for_call(_KERNEL, call, attn_mask is not None), call)
    return _WithWorkspace.apply(query, key, value, attn_mask, (dropout_p, is_causal, scale), held)


class _WithWorkspace(torch.autograd.Function):
    """The CPU flash kernel and its backward, each holding the GPU kernel's workspace for a moment while it
    runs: the forward's once its outputs exist, the backward's once the gradients exist beside everything the
    backward reads (the saved query, key, value, output and log-sum-exp, the incoming gradient), the moment a
    GPU kernel holds its buffers. The same tensors are saved as the kernel's own autograd node saves."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, options, held):
        dropout_p, is_causal, scale = options
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse, attn_mask)
        ctx.options, ctx.held = options, held
        if held.forward:
            _transient(held.forward, query.device)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, attn_mask = ctx.saved_tensors
        dropout_p, is_causal, scale = ctx.options
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        if ctx.held.backward:
            _transient(ctx.held.backward, query.device)
        return (*grads, None, None, None)


def is_workspace(label: str) -> bool:
    """Whether an allocation's label (``Timeline.at_peak``) is a kernel workspace ``_transient`` made."""
    return label.startswith("aten.empty.memory_format uint8 [") and label.endswith(", 1]")


def _transient(nbytes: int, device: torch.device) -> None:
    """``nbytes`` allocated and freed at once: a point on the step's timeline (the last dim is 1, never
    the vocabulary, so the tracker counts it as an activation)."""
    torch.empty((nbytes, 1), dtype=torch.uint8, device=device)


class _DeviceKernel(torch.overrides.TorchFunctionMode):
    """Runs SDPA on meta tensors as a device runs it (its fused kernel), not as meta does (its math path)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _fused(*args, **kwargs)
        return func(*args, **kwargs)


def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """What ``scaled_dot_product_attention`` runs on a CPU: a boolean mask made the query's dtype (0 where
    kept, -inf where not, as ``convert_boolean_attn_mask`` makes it), then the flash kernel, which takes
    grouped key and value heads as they are (``enable_gqa``)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # One expression: the -inf scalar is freed before the kernel runs, as in SDPA's own conversion.
        attn_mask = torch.where(attn_mask, 0.0, torch.scalar_tensor(-math.inf, dtype=query.dtype, device=attn_mask.device))
    return _flash(query, key, value, dropout_p, is_causal, attn_mask, scale)


def sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "meta":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with _DeviceKernel():
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register(choice: str = FLASH) -> str:
    """The ``attn_implementation`` a model is built with to run ``choice`` (registered with transformers)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if choice == FLASH:
        AttentionInterface.register(NAME, causal_attention)
        return NAME
    if choice == SDPA:
        AttentionInterface.register(SDPA_NAME, sdpa_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_NAME, sdpa_mask)
        return SDPA_NAME
    if choice == EAGER:
        return EAGER
    raise ValueError(f"attention {choice!r} is not modelled; choose one of {', '.join(CHOICES)}")


def _model_class(config) -> Optional[type]:
    from transformers import AutoModelForCausalLM

    try:
        found = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None
    return found[0] if isinstance(found, tuple) else found  # a mapping entry can name several classes


def default_for(config) -> Tuple[str, str]:
    """The attention transformers runs for ``config`` when none is asked for, and why: the config's own
    ``attn_implementation`` where it names one, else sdpa where the model class supports it, else eager
    (transformers' ``get_correct_attn_implementation``)."""
    own = config._attn_implementation_internal if hasattr(config, "_attn_implementation_internal") else None
    if isinstance(own, str):
        return own, "the config's attn_implementation"
    cls = _model_class(config)
    name = cls.__name__ if cls is not None else type(config).__name__
    if cls is None or getattr(cls, "_supports_sdpa", False):
        return SDPA, f"transformers' default for {name}"
    return EAGER, f"transformers' default for {name}, which has no sdpa support"


def refusal(config, choice: str) -> Optional[str]:
    """Why transformers would not run ``choice`` for ``config`` (None: it would): the model class does not
    support it, or sdpa is asked of a model with attention softcapping (sdpa raises on it at the first
    forward). Also any choice the planner does not model."""
    if choice not in CHOICES:
        return (f"attention {choice!r} is not modelled: the planner models {', '.join(CHOICES)}; give --attention "
                "with one of them")
    cls = _model_class(config)
    if cls is not None:
        supported = {SDPA: getattr(cls, "_supports_sdpa", False),
                     FLASH: getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False),
                     EAGER: True}
        if not supported[choice]:
            return f"{cls.__name__} does not support attn_implementation='{choice}' in transformers; choose another --attention"
    if choice == SDPA and getattr(config.get_text_config(), "attn_logit_softcapping", None) is not None:
        return ("sdpa does not support the config's attention softcapping (attn_logit_softcapping): transformers raises "
                "at the first forward; give --attention eager or flash_attention_2")
    return None


def sliding_window(config) -> Optional[int]:
    """The window of the config's sliding-window layers (None: it has none): those ``layer_types`` names
    where the config has them, else every layer where it has a window (Mistral)."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if not window or (isinstance(layer_types, list) and "sliding_attention" not in layer_types):
        return None
    return int(window)


def describe(config, choice: str) -> str:
    """What ``choice`` holds, per layer kind of ``config``, in one sentence of the plan's notes."""
    window = sliding_window(config)
    if choice == FLASH:
        return ("flash_attention_2: a flash kernel on every layer (no mask, no [tokens, tokens] buffer; a sliding window "
                "changes no memory)")
    if choice == SDPA:
        sliding = ("" if window is None else
                   f"; the sliding-window layers, from {window:,} tokens (the window) on, a boolean [batch, 1, tokens, "
                   "tokens] mask built once per forward, turned by each layer into a mask of the model's dtype that its "
                   "kernel keeps for the backward, with key and value repeated to every query head (CUDA's memory-"
                   "efficient kernel, modelled by its CPU counterpart)")
        return ("sdpa: full-attention layers a fused kernel with no mask (as FlashAttention, no [tokens, tokens] buffer)"
                + sliding)
    return ("eager: every layer [batch, heads, tokens, tokens] scores and their float32 softmax kept for the backward, "
            "with an additive [batch, 1, tokens, tokens] mask of the model's dtype built once per forward per layer kind")


def workspace_note(config, choice: str, seq: int, sp: int = 1, batch: int = 1,
                   dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> Optional[str]:
    """The plan's line naming the GPU kernel assumed for ``choice`` and what its workspace adds at ``seq``
    tokens, on a rank of SP over ``sp`` or TP over ``tp`` (None where the attention has none: eager)."""
    from .attention_workspace import SDPA_EFFICIENT, TITLES, for_config

    held = for_config(config, seq, batch, sp, dtype, choice, tp=tp)
    if held is None:
        return None
    ranks = sp * tp
    rank = f" per rank (its 1/{ranks} of the heads over the whole sequence)" if ranks > 1 else ""
    masked = (f"; the masked sliding-window calls, {TITLES[SDPA_EFFICIENT]}" if choice == SDPA
              and sliding_window(config) is not None else "")
    return (f"attention workspace (a GPU kernel's own buffers, held while each layer's attention backward runs, "
            f"transient): {held.describe()} at {seq:,} tokens{rank}{masked}.")


@contextlib.contextmanager
def positions_read() -> Iterator[None]:
    """While a step runs: transformers' packed-sequence check on meta position ids answered as the planner's
    positions answer it (one sequence a row); on any other device it runs as it is."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    def one_sequence_a_row(position_ids: torch.Tensor) -> Any:
        if position_ids.device.type != "meta":
            return original(position_ids)
        with _OneSequenceARow():
            return original(position_ids)

    masking_utils.find_packed_sequence_indices = one_sequence_a_row
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


class _OneSequenceARow(torch.overrides.TorchFunctionMode):
    """The check's one read (``(packed[:, -1] == 0).all()``) answered True: no row holds a second sequence."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__bool__ and args[0].device.type == "meta":
            return True
        return func(*args, **(kwargs or {}))
