"""The tiled call's input, saved for backward by a node of its own that runs *before* the shard loop.

Why: non-reentrant activation checkpointing (``checkpoint(..., use_reentrant=False)``, HF's
``gradient_checkpointing_enable``, ``checkpoint_wrapper``) recomputes a region in backward only until
every tensor its forward saved has been recomputed, then stops ("early stop"). A custom Function's
saved tensors are packed after its forward has run, so an input saved by the sharded Function itself
is packed after the whole shard loop: the checkpoint's recompute would run the MLP's forward in full,
only for the tiled backward to recompute it once more (3 MLP forwards per step). Saved here, the input
is packed before the loop; where the MLP is the last thing in the region that saves a tensor (Llama,
Qwen, Mistral: the MLP, then a residual add) the recompute stops before the MLP runs: 2 forwards.
Where something after the MLP saves its output (Gemma2's ``post_feedforward_layernorm``), the
recompute runs on through the MLP, as it must.

The sharded Function reads the input from this node (``InputHolder.tensor``): unpacking it is what
makes a checkpoint recompute the region up to here.

The node exists for saved-tensor hooks, which is how every non-reentrant checkpoint (and activation
offload such as ``save_on_cpu``) sees a saved tensor; where none is active while the forward runs,
nothing can stop early, and the sharded Function saves its input itself: one autograd node fewer
(about 20 us per forward+backward on CPU, ``tiled-mlp bench-overhead``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


def saved_tensor_hooks_active() -> bool:
    """Whether a saved-tensor hook (a non-reentrant checkpoint's) would see what is saved now. True
    where this torch cannot tell: the saving node is always right, only slower."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
    except (AttributeError, TypeError, RuntimeError):
        return True


class InputHolder:
    """Where the sharded Function finds its input in backward: the saving node."""

    __slots__ = ("node",)

    def __init__(self) -> None:
        self.node: Optional[Any] = None

    def tensor(self) -> torch.Tensor:
        assert self.node is not None, "SaveInput ran before the sharded Function"
        (x,) = self.node.saved_tensors
        return x


class SaveInput(torch.autograd.Function):
    """``x`` -> a view of ``x``, saving ``x``. ``anchors`` (the parameters) are inputs only so that the
    node is recorded, and so saves ``x``, whenever the call needs a backward at all: with a frozen
    input, autograd records no node whose inputs all lack gradients."""

    @staticmethod
    def forward(ctx, holder: InputHolder, x: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        holder.node = ctx
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, grad if ctx.needs_input_grad[1] else None, *([None] * (len(ctx.needs_input_grad) - 2)))


def save_input(x: torch.Tensor, anchors: Sequence[torch.Tensor]):
    """(the tensor the sharded Function should take as its input, the holder or None).

    None when no backward will need ``x`` through this node (no graph is built, or nothing that
    would record the node requires grad) or when no saved-tensor hook is active (no checkpoint to
    stop early): the sharded Function then saves ``x`` itself."""
    if not torch.is_grad_enabled() or not saved_tensor_hooks_active():
        return x, None
    if not (x.requires_grad or any(t.requires_grad for t in anchors)):
        return x, None
    holder = InputHolder()
    return SaveInput.apply(holder, x, *anchors), holder
