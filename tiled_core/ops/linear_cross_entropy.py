"""``torch.ops.tiled_mlp.linear_cross_entropy``: the tiled loss of a plain linear head as one custom op, so that a
compiled model traces it without a graph break. It returns the loss *and* its gradients, formed in the forward as
the eager loss forms them; the backward scales them by the incoming gradient (exact: the loss is a scalar). A
double backward is refused, under AOT autograd too (``loss_gradient_scale``): a product of the formed gradients
alone would let it through with every second-order term silently zero.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..kernels.cross_entropy import CrossEntropyOptions, check_targets
from ..kernels.lm_head import LinearHeadKernel, loss_dtype
from ..shard_plan import make_shard_plan
from ..sharded_autograd import LOSS_DOUBLE_BACKWARD_ERROR, GradAccumulator, reduce_shards
from .gradient_slots import fake_slots, slot


@torch.library.custom_op("tiled_mlp::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor], ignore_index: int, label_smoothing: float,
                         logit_softcap: Optional[float], z_loss: float, num_shards: int,
                         accum_dtype: Optional[torch.dtype], grad_x: bool, grad_weight: bool,
                         grad_bias: bool) -> List[torch.Tensor]:
    """``[loss, dx, d weight, d bias]``: the loss of ``x @ weight.T (+ bias)`` against shifted ``targets``, times
    ``scale``, summed over tokens; each gradient where asked for, else a 0-element tensor."""
    options = CrossEntropyOptions(ignore_index, label_smoothing, logit_softcap, z_loss)
    check_targets(targets, weight.shape[0], ignore_index)
    params = [weight] if bias is None else [weight, bias]
    needed = [grad_weight] if bias is None else [grad_weight, grad_bias]
    grads = GradAccumulator(params, needed, accum_dtype) if any(needed) else None
    dx_flat = x.new_empty((x.numel() // x.shape[-1], x.shape[-1])) if grad_x else None
    kernel = LinearHeadKernel(weight, bias, options)
    plan = make_shard_plan(targets.numel(), num_shards)
    loss = reduce_shards(kernel, x, targets, scale, dx_flat, grads, params, plan.slice_tuple)
    found = grads.results() if grads is not None else [None] * len(params)
    d_bias = found[1] if bias is not None else None
    return [loss, slot(None if dx_flat is None else dx_flat.view_as(x), x), slot(found[0], weight), slot(d_bias, weight)]


@linear_cross_entropy.register_fake
def _linear_cross_entropy_fake(x, targets, scale, weight, bias, ignore_index, label_smoothing, logit_softcap, z_loss,
                               num_shards, accum_dtype, grad_x, grad_weight, grad_bias):
    return [x.new_empty((), dtype=loss_dtype(weight.dtype)),
            *fake_slots((x, weight, weight if bias is None else bias), (grad_x, grad_weight, bias is not None and grad_bias))]


@torch.library.custom_op("tiled_mlp::loss_gradient_scale", mutates_args=())
def loss_gradient_scale(grad_loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gradient that reaches the loss (a copy: an op returns no alias of its input). ``weight``, the head's,
    is read by nothing: it ties the backward to a tensor that requires grad, so that a backward of this backward
    reaches an op with no autograd formula, or AOT autograd's refusal of double backward, and stops there."""
    return grad_loss.clone()


@loss_gradient_scale.register_fake
def _loss_gradient_scale_fake(grad_loss, weight):
    return torch.empty_like(grad_loss)


def _setup_context(ctx, inputs, output) -> None:
    weight = inputs[3]
    _, dx, d_weight, d_bias = output
    ctx.save_for_backward(dx, d_weight, d_bias)
    ctx.weight = weight  # a parameter, alive anyway: held for ``loss_gradient_scale``


def _backward(ctx, output_grads):
    if torch.is_grad_enabled():  # run by autograd itself (not traced): grad mode is on where it builds a graph
        raise RuntimeError(LOSS_DOUBLE_BACKWARD_ERROR)
    grad_loss = output_grads[0]  # the op returns a list: its gradients arrive as one (those of the gradients unused)
    factor = loss_gradient_scale(grad_loss, ctx.weight)
    # As the eager loss: the product with the 0-dim gradient in the gradient's own dtype. A gradient needed but
    # not formed (its grad_* argument False) is an empty slot, which autograd refuses for its shape.
    needs = ctx.needs_input_grad
    dx, d_weight, d_bias = (formed * factor if need else None
                            for formed, need in zip(ctx.saved_tensors, (needs[0], needs[3], needs[4]), strict=True))
    return dx, None, None, d_weight, d_bias, None, None, None, None, None, None, None, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
