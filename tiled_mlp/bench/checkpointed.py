"""Checkpointed regions: where tiling makes training faster as well as leaner.

Long-context training checkpoints every decoder layer. Untiled, a checkpointed MLP runs its forward
twice per step (the forward, the checkpoint's recompute); DeepSpeed's TiledMLP three times (plus its
own backward recompute). Ours saves its input before the shard loop (``tiled_core/sharded_autograd.py``'s ``SaveInput``),
so the checkpoint's recompute stops before the MLP and its own backward recompute is the second and
last forward: in matmul units for a gated MLP, untiled 3 + 3 + 6 = 12, DeepSpeed 3 + 3 + 3 + 6 = 15,
ours 3 + 8 = 11.

Two regions, each one non-reentrant checkpoint (``torch.utils.checkpoint``, as HF and torchtitan use
it): the MLP half of a decoder layer (RMSNorm, gated MLP, residual add) and a whole HF Llama decoder
layer (attention too). Per implementation: fwd+bwd time (rounds interleaved, as ``tiled-mlp bench``),
exact peak memory (the live-storage tracker; the allocator's peak on CUDA), and the MLP forwards per step, counted as passes of
the gate projection over all tokens.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from tiled_mlp import TiledMLP

from .impls import IMPLS as MLP_IMPLS
from .measure import make_inputs, peak_bytes, step_seconds
from .mlp import SwiGLUMLP

REGIONS = ("mlp-half", "llama-layer")
IMPLS = ("untiled", "ours", "deepspeed")


class MLPHalf(nn.Module):
    """The MLP half of a Llama decoder layer: x + mlp(norm(x))."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-6, dtype=dtype)
        self.mlp = SwiGLUMLP(hidden, intermediate, dtype=dtype)

    def forward(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLayer(nn.Module):
    """An HF LlamaDecoderLayer with its rotary embedding, called on hidden states alone."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, heads: int):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                             num_key_value_heads=heads, max_position_embeddings=1 << 20)
        config._attn_implementation = "sdpa"
        self.layer = LlamaDecoderLayer(config, layer_idx=0).to(dtype)
        self.rotary = LlamaRotaryEmbedding(config)
        self.mlp = self.layer.mlp

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return self.layer(x, position_ids=positions, position_embeddings=self.rotary(x, positions))


class Checkpointed(nn.Module):
    region: Any  # MLPHalf or LlamaLayer: each has .mlp

    def __init__(self, region: nn.Module):
        super().__init__()
        self.region = region

    def forward(self, x):
        return checkpoint(self.region, x, use_reentrant=False)


def build(region: str, impl: str, hidden: int, intermediate: int, dtype: torch.dtype, seq: int,
          num_shards, heads: int, device: torch.device) -> Checkpointed:
    torch.manual_seed(0)
    inner = MLPHalf(hidden, intermediate, dtype) if region == "mlp-half" else LlamaLayer(hidden, intermediate, dtype, heads)
    inner.to(device)
    for p in inner.parameters():  # the same weights for every implementation
        with torch.no_grad():
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1])) if p.dim() > 1 else p.fill_(1.0)
    if impl == "ours":
        TiledMLP(inner.mlp, num_shards=num_shards)
    elif impl == "deepspeed":
        # The bench's own peer (its policy: ~hidden tokens per shard), as the MLP's forward.
        inner.mlp.forward = MLP_IMPLS["deepspeed"](inner.mlp, max(1, math.ceil(seq / hidden)))  # type: ignore[method-assign]
    return Checkpointed(inner)


class GatePasses(TorchDispatchMode):
    """Counts the tokens the gate projection's forward sees. At the dispatch level, which (unlike a
    torch-function mode) also sees what runs inside backward: the checkpoint's recompute, and
    DeepSpeed's and our backward recompute. A matmul reading the gate weight that makes a
    ``[tokens, intermediate]`` result is a forward pass of the gate; the input gradient's matmul,
    which reads it too, makes ``[tokens, hidden]``."""

    def __init__(self, gate_weight: torch.Tensor):
        super().__init__()
        self._storage = gate_weight.untyped_storage().data_ptr()
        self._intermediate = gate_weight.shape[0]
        self.tokens = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default) \
                and isinstance(out, torch.Tensor) and out.shape[-1] == self._intermediate:
            if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self._storage for a in args):
                self.tokens += out.numel() // self._intermediate
        return out


def mlp_forwards(module: Checkpointed, x: torch.Tensor, dy: torch.Tensor) -> float:
    mlp = module.region.mlp
    counter = GatePasses(mlp.gate_proj.weight)
    x = x.detach().requires_grad_()
    with counter:
        module(x).backward(dy)
    module.zero_grad(set_to_none=True)
    return counter.tokens / (x.numel() // x.shape[-1])


def run(region: str, impls: List[str], hidden: int, intermediate: int, seq: int, dtype: torch.dtype,
        repeats: int, heads: int, num_shards, on_step: Callable[[str], None],
        device: torch.device = torch.device("cpu")) -> List[Dict[str, Any]]:
    x, dy = make_inputs(seq, hidden, dtype, device)
    modules = {impl: build(region, impl, hidden, intermediate, dtype, seq, num_shards, heads, device) for impl in impls}
    rows: List[Dict[str, Any]] = []
    for impl, module in modules.items():
        forwards = mlp_forwards(module, x, dy)
        peak = peak_bytes(module, module, x, dy)
        mlp = module.region.mlp
        shards = mlp.tiling.last_num_shards if isinstance(mlp, TiledMLP) else (
            max(1, math.ceil(seq / hidden)) if impl == "deepspeed" else 1)
        rows.append(dict(region=region, impl=impl, seq=seq, mlp_forwards=forwards, peak_mb=peak / 2**20, shards=shards))
        on_step(f"{region} {impl}: forwards and memory")
    everything = nn.ModuleList(modules.values())
    seconds = step_seconds(modules, everything, x, dy, repeats=repeats,
                           on_round=lambda r: on_step(f"{region}: timed round {r + 1}/{repeats}"))
    for row in rows:
        row["ms"] = seconds[row["impl"]] * 1e3
    return rows


def format_rows(rows: List[Dict]) -> str:
    lines = ["| region | impl | shards | MLP forwards / step | ms | vs untiled | peak MiB | vs untiled |",
             "|---|---|---|---|---|---|---|---|"]
    base = {r["region"]: r for r in rows if r["impl"] == "untiled"}
    for r in rows:
        b = base.get(r["region"])
        time_ratio = f"{r['ms'] / b['ms']:.3f}" if b else "-"
        mem_ratio = f"{r['peak_mb'] / b['peak_mb']:.3f}" if b else "-"
        lines.append(f"| {r['region']} | {r['impl']} | {r['shards']} | {r['mlp_forwards']:.0f} | {r['ms']:.1f} | "
                     f"{time_ratio} | {r['peak_mb']:.1f} | {mem_ratio} |")
    return "\n".join(lines)


def plot_rows(rows: List[Dict], path: str, what: str = "CPU fp32") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regions = list(dict.fromkeys(r["region"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (key, label) in zip(axes, [("ms", "fwd+bwd time, ratio to untiled"), ("peak_mb", "peak memory, ratio to untiled")], strict=True):
        for i, region in enumerate(regions):
            sub = [r for r in rows if r["region"] == region]
            base = next(r[key] for r in sub if r["impl"] == "untiled")
            for j, r in enumerate(sub):
                bar = ax.bar(i + 0.27 * (j - 1), r[key] / base, width=0.25, color=f"C{j}", label=r["impl"] if i == 0 else None)
                ax.bar_label(bar, labels=[f"{r[key] / base:.2f}\n{r['mlp_forwards']:.0f} fwd"], fontsize=7)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(regions)), regions)
        ax.set_ylim(0, 1.3 * max(r[key] / next(b[key] for b in rows if b["impl"] == "untiled" and b["region"] == r["region"])
                                 for r in rows))
        ax.set_title(label, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"checkpointed regions (non-reentrant), {what}; labels: MLP forwards per step", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
