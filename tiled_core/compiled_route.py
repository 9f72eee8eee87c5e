"""What a tiled module's call becomes when ``torch.compile`` traces it: the eager call's own decision, run
once where the call is traced on a stand-in input, picks ``untiled`` (the module's own forward), ``gated_op``
or ``norm_op`` (one custom op of ``ops/``), or ``eager`` (the eager call behind one graph break, the reason in
``module.tiling.compiled_reason``). docs/compile.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import nn

from . import dynamo_support
from .gated_spec import hook_count
from .ops.map_ops import gated_mlp, rms_norm
from .tiled_call import autograd_carries_the_call, decide_map_call, module_strategy
from .tiling_state import TilingState, tiling_of
from .validation import check_input

EAGER, UNTILED, GATED_OP, NORM_OP = "eager", "untiled", "gated_op", "norm_op"
# The ops' routes, by the kernel the eager decision chose: what ``last_path`` reports for them.
_OP_KERNELS = {GATED_OP: "fast", NORM_OP: "norm"}


@dataclass(frozen=True)
class CompiledRoute:
    """What a traced call runs (``kind``) and why; for an op, its parameters by name, its layout arguments and the
    plain values its kernel's decision read ((child's name, or "" for the module; attribute): ``GatedShardKernel.reads``)."""

    kind: str
    reason: str
    num_shards: int = 1
    param_names: Tuple[str, ...] = ()
    op_args: Tuple[Any, ...] = ()
    accum_dtype: Optional[torch.dtype] = None
    reads: Tuple[Tuple[str, str], ...] = ()


def _eager_route(reason: str) -> CompiledRoute:
    return CompiledRoute(EAGER, f"eager tiled call (a graph break): {reason}")


def decide_route(module: nn.Module, default_inputs: bool, shape: Tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> CompiledRoute:
    """The route of a call of ``module`` on such an input, by the eager call's own decision. ``default_inputs``:
    the module's class takes its hidden states alone (the ``TiledMLP`` default ``tiled_inputs``)."""
    state = tiling_of(module)
    if not default_inputs:
        return _eager_route(f"{type(module).__name__} passes other sharded inputs to the tiled call")
    # One written into the instance's dict (Liger's ``_bind_method_to_module``) is adopted by the eager call.
    if state.instance_forward is not None or "forward" in vars(module):
        return _eager_route("an instance forward is installed (what each shard runs is not the class's forward)")
    strategy = module_strategy(module, state)
    strategy.check_supported(module)
    if not autograd_carries_the_call(strategy):
        return _eager_route(f"the {strategy.name} strategy gathers parameters or delivers gradients itself")
    # A stand-in input: the decision reads the input's sizes, dtype and device, never its values.
    x = torch.empty((), dtype=dtype, device=device).expand(shape)
    decision = decide_map_call(module, state, strategy, x, (), compiling=True)
    kernel = decision.kernel
    if kernel is None:
        return CompiledRoute(UNTILED, f"{decision.reason} (traced as the module's own forward)")
    if decision.kernel_name not in _OP_KERNELS.values() or getattr(kernel, "layout", None) is None:
        return _eager_route(f"the {decision.kernel_name} kernel runs the call (only the gated fast kernel and the "
                            "norm kernel are ops)")
    if strategy.local_view(module, kernel.params) is not None:
        return _eager_route("the parameters are distributed (tensor parallelism)")
    names = {id(p): name for name, p in module.named_parameters()}
    if any(id(p) not in names for p in kernel.params):
        return _eager_route("a parameter the kernel reads is not the module's own")
    assert decision.num_shards is not None, "a decision with a kernel has a shard count"
    param_names = tuple(names[id(p)] for p in kernel.params)
    layout = kernel.layout
    if decision.kernel_name == "norm":
        return CompiledRoute(NORM_OP, f"{decision.reason} (traced as one op, tiled_mlp::rms_norm)", decision.num_shards,
                             param_names, (layout.eps, layout.offset, layout.multiply), state.grad_accum_dtype)
    return CompiledRoute(GATED_OP, f"{decision.reason} (traced as one op, tiled_mlp::gated_mlp)", decision.num_shards,
                         param_names, (layout.slots, layout.scales, kernel.activation.name, state.use_fused_kernel),
                         state.grad_accum_dtype, kernel.reads)


@dynamo_support.decided_where_traced
def _traced_route(module: nn.Module, default_inputs: bool, shape: Tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> CompiledRoute:
    """``decide_route`` where Dynamo traces the call."""
    route = decide_route(module, default_inputs, shape, dtype, device)
    # Report fields (as the eager call writes them): the compiled call runs what was decided here, and
    # the op cannot write them when it runs. An eager route writes its own at each call.
    fields = tiling_of(module).__dict__
    fields["compiled_reason"] = route.reason
    if route.kind != EAGER:
        fields["last_path"] = _OP_KERNELS.get(route.kind, "untiled")
        fields["last_num_shards"], fields["last_reason"] = route.num_shards, route.reason
    return route


@dynamo_support.decided_where_traced
def _rests_on(watched: Tuple[Any, ...]) -> None:
    """Nothing: ``watched`` (``_watched``) is passed only so that Dynamo guards on it, and the graph is traced
    again, with the route decided anew, when anything in it changes."""


def _param(module: nn.Module, name: str) -> torch.Tensor:
    for part in name.split("."):
        module = getattr(module, part)
    return module  # type: ignore[return-value]  # the last part names a parameter


@dynamo_support.disable
def _eager_call(module: nn.Module, reason: str, args: Sequence[Any], kwargs: dict) -> torch.Tensor:
    if reason:  # a route decided where traced wrote its own
        tiling_of(module).__dict__["compiled_reason"] = _eager_route(reason).reason
    return module._tiled_forward(*args, **kwargs)  # type: ignore[operator]  # TiledMLP's


def _watched(module: nn.Module, reads: Tuple[Tuple[str, str], ...]) -> Tuple[Any, ...]:
    """What the route rests on besides the module and the input, read in traced code so that Dynamo guards on each;
    ``reads``: the plain values the route's kernel was decided on (``CompiledRoute.reads``). Nothing is read through
    ``module.__dict__`` or ``vars(module)``: Dynamo's variables for a module and for its dict refer to each other, a
    cycle that kept the module alive after ``torch._dynamo.reset()`` and ``del`` until the collector ran. (A forward
    written into the instance dict is seen where the route is decided.)"""
    state: TilingState = module.tiling  # type: ignore[assignment]  # set on every tiled module
    return (state.path, state.num_shards, state.grad_accum_dtype, state.use_fused_kernel,
            state.instance_forward is None,
            type(module)._tiled_base.forward, type(getattr(module, "act_fn", None)),  # type: ignore[attr-defined]
            tuple(hook_count(m) for m in module.modules()),
            tuple(getattr(getattr(module, child) if child else module, key) for child, key in reads))


def compiled_call(module: nn.Module, default_inputs: bool, args: Sequence[Any], kwargs: dict) -> torch.Tensor:
    if not dynamo_support.TRACES_TILED_CALLS:
        return _eager_call(module, dynamo_support.REASON, args, kwargs)
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
        return _eager_call(module, "the call passes keyword arguments or more than the hidden states", args, kwargs)
    x = args[0]
    if default_inputs:  # the eager call's input checks, traced (the op would flatten a 1-D input into one token)
        check_input(x, module)
    route = _traced_route(module, default_inputs, tuple(x.shape), x.dtype, x.device)
    _rests_on(_watched(module, route.reads))
    if route.kind == UNTILED:
        return type(module)._tiled_base.forward(module, x)  # type: ignore[attr-defined]
    if route.kind == GATED_OP:
        slots, scales, activation, use_fused = route.op_args
        return gated_mlp(x, [_param(module, name) for name in route.param_names], list(slots), list(scales),
                         activation, use_fused, route.num_shards, route.accum_dtype)
    if route.kind == NORM_OP:
        return rms_norm(x, _param(module, route.param_names[0]), *route.op_args, route.num_shards, route.accum_dtype)
    return _eager_call(module, "", (x,), {})
