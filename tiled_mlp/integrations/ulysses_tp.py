"""Ulysses SP refuses tensor parallelism on the attention it wraps.

DeepSpeed's ``UlyssesSPAttentionHF`` is built from the model config's head counts: it all-to-alls each rank's
[its tokens, every head] into [every token, its share of the heads], and asserts that shape. Under DTensor tensor
parallelism on the attention projections (``parallelize_module`` with ``ColwiseParallel`` on q/k/v and
``RowwiseParallel`` on o) a rank holds only its TP slice of the heads, and DeepSpeed's shape assertion stops the
first attention (measured: SP=2 beside TP=2 on 4 gloo ranks), naming neither the problem nor a fix. Composing the
two would need the Ulysses attention built on the local head counts, every rank of a TP group holding the same
tokens (SP groups orthogonal to the TP groups), and the TP-sharded projections' gradients summed over the SP
ranks: none of which DeepSpeed's registration or this library sets up or can check, so it is refused.

Decided by what the parameters are: a ``DTensor`` parameter of an attention module. At the attention call it
is exact: FSDP2 has unsharded its own parameters into plain tensors by then (the attention runs inside the
FSDP2 units' forward), so a DTensor left there is another parallelism's. At apply time FSDP2's sharded
parameters are DTensors too, so the check there runs only on a model with no FSDP2 unit (``fully_shard``
applied after SP is the usual order; the call check covers the other).
"""
from __future__ import annotations

from typing import List

from torch import nn

TENSOR_PARALLEL_ERROR = (
    "sequence parallelism: {module}'s parameters {names} are DTensors (tensor parallelism: parallelize_module). "
    "DeepSpeed's Ulysses attention exchanges whole attention heads across the SP ranks and is built for the "
    "config's {heads} query heads; under tensor parallelism a rank holds only its slice of the heads, which the "
    "all-to-all would treat as whole. Ulysses SP and tensor parallelism on the attention do not compose here: "
    "leave q_proj/k_proj/v_proj/o_proj out of the tensor-parallel plan, or use "
    "tensor parallelism without sequence parallelism."
)


def dtensor_parameter_names(module: nn.Module) -> List[str]:
    """The names of ``module``'s parameters that are DTensors."""
    from torch.distributed.tensor import DTensor

    return [name for name, p in module.named_parameters() if isinstance(p, DTensor)]


def check_attention_not_tensor_parallel(attention: nn.Module, heads: object) -> None:
    """Raise ``TENSOR_PARALLEL_ERROR`` where ``attention`` (a module Ulysses wraps) holds a DTensor parameter."""
    names = dtensor_parameter_names(attention)
    if names:
        raise ValueError(TENSOR_PARALLEL_ERROR.format(module=type(attention).__name__, names=names, heads=heads))


def attention_modules(model: nn.Module) -> List[nn.Module]:
    """The model's attention modules: those carrying ``num_key_value_groups``, the attribute DeepSpeed's Ulysses
    attention reads and writes on the module it is called with (every Hugging Face attention has it)."""
    return [m for m in model.modules() if isinstance(getattr(m, "num_key_value_groups", None), int)]


def check_no_tensor_parallel_attention(model: nn.Module, heads: object) -> None:
    """At apply time: refused where an attention module holds a DTensor parameter and no FSDP2 unit is on the
    model (whose own sharded parameters are DTensors until its forward; the attention call decides there)."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return
    for attention in attention_modules(model):
        check_attention_not_tensor_parallel(attention, heads)
