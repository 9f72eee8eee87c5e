"""Tensor parallelism on the output head: ``lm_head`` under ``ColwiseParallel`` (torchtitan's layout, or Hugging
Face's own colwise style), its weight a DTensor ``Shard(0)`` over a 1-D mesh. ``vocab_slice`` hands the tiled loss
plain local tensors. What is refused, and the proof: docs/backends.md, "The vocabulary-parallel tiled loss".
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from . import hf_tensor_parallel as hf_tp
from .base import SequenceParallelAware, Strategy, UnsupportedBackendError, VocabSlice
from .tensor_parallel import (
    has_dtensor,
    is_sequence_parallel_module,
    layout_of,
    linear_style,
    style_hooks_of,
)

LAYOUT_ERROR = (
    "tiled loss: {head} is tensor-parallel with {layout}; the vocabulary-parallel loss takes lm_head "
    "parallelized with ColwiseParallel over a 1-D mesh (weight{bias} Shard(0): each rank holds vocab/tp rows). "
    "{fix}"
)
STYLE_FIX = ("Parallelize lm_head with ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) "
             "(input_layouts=Shard(1) for a sequence-parallel input), or compute this loss untiled (loss_parallel()).")
MESH_FIX = ("A weight over a 2-D mesh is FSDP2's shard of it outside the forward of its unit: keep lm_head out of "
            "fully_shard (or in a unit that does not reshard it after forward), or compute this loss untiled.")
HF_STYLE_FIX = ("Lay lm_head out with Hugging Face's 'colwise' or 'colwise_gather_output' style (its ColwiseParallel, "
                "in the model's tp_plan), or compute this loss untiled.")
NOT_LINEAR_STYLE_ERROR = (
    "{module} is tensor-parallel with {layout}: a tiled call computes under tensor parallelism only as a gated MLP "
    "whose Linears are ColwiseParallel / RowwiseParallel, or as the loss of an lm_head parallelized with "
    "ColwiseParallel (a module that is not a Linear under SequenceParallel alone, a norm, runs on the rank's own "
    "tokens). Leave {module} untiled, or, for an lm_head, parallelize it with ColwiseParallel(output_layouts="
    "Shard(-1), use_local_output=False)."
)
SEQUENCE_GROUP_ERROR = (
    "tiled loss: {head} is vocabulary-parallel (ColwiseParallel) and a sequence_group was given: the loss split "
    "over a sequence-parallel group and its vocabulary over a tensor-parallel one together is not supported. "
    "Give the tensor-parallel head its sequence through ColwiseParallel(input_layouts=Shard(1)) instead."
)


class SumGradOverGroup(torch.autograd.Function):
    """The identity forward; backward sums the gradient over ``group`` in place: it is the tiled loss's own ``dx``
    buffer, made for this one use."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class TensorParallelHeadStrategy(SequenceParallelAware, Strategy):
    name = "tensor_parallel_head"
    # Above FSDP2: a head whose weight FSDP2 also shards (a 2-D mesh) is refused here, by its layout.
    priority = 150

    @classmethod
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        """The module itself carries a tensor-parallel style and a DTensor ``weight`` (an MLP whose Linears are
        parallelized carries neither), and is no ``SequenceParallel`` norm. Not gated on the default process group:
        a DTensor's mesh holds its own (the planner's fake group)."""
        # From the parameter dict: ZeRO-3 would gather a weight read as an attribute inside another module's forward.
        weight = module._parameters.get("weight")
        if weight is None or not has_dtensor([weight]):
            return False
        if not style_hooks_of(module):
            # Hugging Face's own tensor parallelism registers no hook: it marks the modules it laid out.
            return bool(vars(module).get("_is_hooked"))
        return isinstance(module, nn.Linear) or not is_sequence_parallel_module(module)

    def check_supported(self, module: nn.Module) -> None:
        head = type(module).__name__
        weight: Any = getattr(module, "weight", None)  # a DTensor (claims)
        bias: Any = getattr(module, "bias", None)
        bias_text = " and bias" if bias is not None else ""
        problem = hf_tp.version_problem(module)
        if problem:
            raise UnsupportedBackendError(problem)
        style = linear_style(module)
        if style is not None and style.kind == "colwise" and has_dtensor([weight]) and weight.device_mesh.ndim > 1:
            # Laid out as asked, then sharded again over a second mesh dimension (fully_shard over the TP head).
            raise UnsupportedBackendError(LAYOUT_ERROR.format(
                head=head, layout=f"its weight {layout_of(weight)}", bias=bias_text, fix=MESH_FIX))
        if style is None or style.kind != "colwise" or style.mesh != weight.device_mesh:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

            classes = {cls for _, cls in style_hooks_of(module)}
            if classes:  # torch's styles; else Hugging Face's own (``claims``)
                found = "/".join(sorted(cls.__name__ for cls in classes))
                linear, fix = any(issubclass(cls, (ColwiseParallel, RowwiseParallel)) for cls in classes), STYLE_FIX
            else:
                installed = hf_tp.installed_style(module)
                found = f"Hugging Face's {type(installed).__name__ if installed is not None else 'tensor parallelism'}"
                linear, fix = isinstance(module, nn.Linear), HF_STYLE_FIX
            layout = f"{found} (weight {layout_of(weight)})"
            if not linear:
                # Not a Linear's style (SequenceParallel on a norm, say): not a head, whichever call tiles it.
                raise UnsupportedBackendError(NOT_LINEAR_STYLE_ERROR.format(module=head, layout=layout))
            raise UnsupportedBackendError(LAYOUT_ERROR.format(head=head, layout=layout, bias=bias_text, fix=fix))
        from torch.distributed.tensor import Shard

        for what, tensor in (("weight", weight), ("bias", bias)):
            if tensor is None:
                continue
            one_mesh = has_dtensor([tensor]) and tensor.device_mesh.ndim == 1
            if not one_mesh or (tuple(tensor.placements), tensor.device_mesh) != ((Shard(0),), weight.device_mesh):
                fix = MESH_FIX if has_dtensor([tensor]) and not one_mesh else STYLE_FIX
                raise UnsupportedBackendError(LAYOUT_ERROR.format(
                    head=head, layout=f"its {what} {layout_of(tensor)}", bias=bias_text, fix=fix))

    def check_sequence_group(self, module: nn.Module, group: Any) -> None:
        if self.claims(module):
            raise UnsupportedBackendError(SEQUENCE_GROUP_ERROR.format(head=type(module).__name__))

    def vocab_slice(self, head: nn.Module, hidden: torch.Tensor) -> VocabSlice:
        style = linear_style(head)
        assert style is not None, "check_supported found a colwise style"
        head_input = style.prepare_input(hidden)
        weight: Any = head.weight  # DTensors (check_supported)
        bias: Any = head.bias
        mesh = weight.device_mesh
        vocab = weight.shape[0]
        rows = weight.to_local()
        # Shard(0) splits as torch.chunk does: ceil(vocab / tp) rows per rank, the last ranks fewer (or none).
        max_rows = -(-vocab // mesh.size())
        group = mesh.get_group()
        # Asked of the group itself: a mesh over a group of its own needs no default group.
        start = min(group.rank() * max_rows, vocab)
        if rows.shape[0] != min(max_rows, vocab - start):
            raise UnsupportedBackendError(f"tiled loss: {type(head).__name__}'s local weight has {rows.shape[0]} rows, "
                                          f"not the {min(max_rows, vocab - start)} of Shard(0)'s even split of {vocab} "
                                          f"over {mesh.size()} ranks; the vocabulary offset of this rank is unknown")
        hidden_here = SumGradOverGroup.apply(head_input.to_local(), group)
        return VocabSlice(hidden_here, rows,
                          None if bias is None else bias.to_local(), group, start, vocab, max_rows)
