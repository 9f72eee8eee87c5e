"""``torch.ops.tiled_mlp.gated_mlp`` and ``torch.ops.tiled_mlp.rms_norm``: the gated fast kernel and the norm
kernel over token shards as custom ops, so that a compiled model traces a tiled gated MLP or RMSNorm without a
graph break. Each is a pure function of its arguments (the input, the kernel's tensors, its layout's plain values,
the shard count, the gradients' dtype), run through the sharded autograd's shard loops; its backward op recomputes
shard by shard (the gated one gate and up only, never down's forward). The two differ only by data: their
schema, the kernel they build and their output's size (``_map_op``).
"""
from __future__ import annotations

from typing import Any, Callable, List, Sequence

import torch

from ..kernels.base import ShardKernel
from ..kernels.gated import DOWN_WEIGHT_ARG, GatedLayout, GatedShardKernel, gated_activation
from ..kernels.rms_norm import NormLayout, RMSNormShardKernel
from ..shard_plan import make_shard_plan
from ..sharded_autograd import GradAccumulator, backward_shards, forward_shards
from .gradient_slots import fake_slots, slot


def _map_op(name: str, tensors_arg: str, layout_args: str, kernel_of: Callable[..., ShardKernel],
            output_like: Callable[..., torch.Tensor]) -> Any:
    """``tiled_mlp::{name}(x, tensors, *layout, num_shards, accum_dtype)`` and its backward op ``{name}_backward``
    (``[dx, *d tensors]``; ``needs[i]`` False: an empty slot), with their fakes and the registered backward.
    ``tensors_arg``: a list argument (``Tensor[] ...``) or one tensor. ``kernel_of(tensors, layout, device)`` builds
    the shard kernel, ``output_like(x, tensors, layout)`` the empty output. ``save_for_backward`` refuses an input
    edited in place after the forward; a double backward is refused (none is registered)."""
    listed = tensors_arg.startswith("Tensor[]")
    options = f"{layout_args}, SymInt num_shards, ScalarType? accum_dtype"

    def as_list(tensors: Any) -> List[torch.Tensor]:
        return list(tensors) if listed else [tensors]

    def forward(x, tensors, *options):
        tensors, (*layout, num_shards, _) = as_list(tensors), options
        kernel = kernel_of(tensors, layout, x.device)  # first: it refuses a layout the output cannot be sized by
        out = output_like(x, tensors, layout)
        x_flat = x.reshape(-1, x.shape[-1])
        slices = make_shard_plan(x_flat.shape[0], num_shards).slice_tuple
        forward_shards(kernel, x_flat, out.view(-1, out.shape[-1]), slices, tensors)
        return out

    def backward_op_impl(grad_out, x, tensors, *options):
        # Zeros for a needed tensor no shard gave a gradient (a call with no token), as untiled.
        tensors, (*layout, num_shards, accum_dtype, needs) = as_list(tensors), options
        x_flat = x.reshape(-1, x.shape[-1])
        dy_flat = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        dx_flat = x_flat.new_empty(x_flat.shape) if needs[0] else None  # contiguous, as the fake's
        grads = GradAccumulator(tensors, needs[1:], accum_dtype)
        slices = make_shard_plan(x_flat.shape[0], num_shards).slice_tuple
        backward_shards(kernel_of(tensors, layout, x.device), slices, x_flat, dy_flat, dx_flat, grads, tensors)
        dx = None if dx_flat is None else dx_flat.view_as(x)
        return [slot(dx, x), *(slot(g, t) for t, g in zip(tensors, grads.results(zeros_for_unused=True), strict=True))]

    op = torch.library.custom_op(f"tiled_mlp::{name}", forward, mutates_args=(),
                                 schema=f"(Tensor x, {tensors_arg}, {options}) -> Tensor")
    backward_op = torch.library.custom_op(f"tiled_mlp::{name}_backward", backward_op_impl, mutates_args=(),
                                          schema=f"(Tensor grad_out, Tensor x, {tensors_arg}, {options}, bool[] needs)"
                                                 " -> Tensor[]")
    op.register_fake(lambda x, tensors, *options: output_like(x, as_list(tensors), options[:-2]))
    backward_op.register_fake(lambda grad_out, x, tensors, *options: fake_slots((x, *as_list(tensors)), options[-1]))

    def setup_context(ctx, inputs, output) -> None:
        x, tensors, *options = inputs
        ctx.save_for_backward(x, *as_list(tensors))
        ctx.options = options

    def backward(ctx, grad_out):
        x, *tensors = ctx.saved_tensors
        flags = ctx.needs_input_grad  # a list argument's flags are a list
        needs = [flags[0], *as_list(flags[1])]
        grads = backward_op(grad_out, x, tensors if listed else tensors[0], *ctx.options, needs)
        dx, *dtensors = [grad if need else None for grad, need in zip(grads, needs, strict=True)]
        return (dx, dtensors if listed else dtensors[0], *[None] * len(ctx.options))

    op.register_autograd(backward, setup_context=setup_context)
    return op


def _gated_kernel(tensors: List[torch.Tensor], layout: Sequence[Any], device: torch.device) -> GatedShardKernel:
    slots, scales, activation, use_fused = layout
    return GatedShardKernel(GatedLayout(tuple(slots), tuple(scales)), gated_activation(activation, device, use_fused),
                            tensors)


def _gated_output(x: torch.Tensor, tensors: List[torch.Tensor], layout: Sequence[Any]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], tensors[layout[0][DOWN_WEIGHT_ARG]].shape[0]))


def _norm_kernel(tensors: List[torch.Tensor], layout: Sequence[Any], device: torch.device) -> RMSNormShardKernel:
    return RMSNormShardKernel(NormLayout(*layout), tensors[0])


def _norm_output(x: torch.Tensor, tensors: List[torch.Tensor], layout: Sequence[Any]) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=NormLayout(*layout).output_dtype(x.dtype, tensors[0].dtype))


# ``down(act(gate(x) * gs) * (up(x) * us)) * ds``: the projections' tensors, their ``GatedLayout``'s slots and
# factors, the activation, whether a fused activation kernel may run.
gated_mlp = _map_op("gated_mlp", "Tensor[] tensors", "SymInt[] slots, float[] scales, str activation, bool use_fused",
                    _gated_kernel, _gated_output)
# The registered norm formula (``norm_forms``): the weight, and the ``NormLayout``'s eps, offset and multiply dtype.
rms_norm = _map_op("rms_norm", "Tensor weight", "float eps, float offset, str multiply", _norm_kernel, _norm_output)
