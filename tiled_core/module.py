"""``TiledMLP``: tiles any token-wise MLP *in place*, so that nothing but its memory changes.

``TiledMLP(mlp)`` returns ``mlp`` itself, its class swapped for a generated subclass of both
``TiledMLP`` and its own class (``TiledLlamaMLP``), as ``fully_shard`` does for FSDP2. Why in place
and not a wrapper: everything that names parameters (``named_parameters``, PEFT's adapter keys,
DeepSpeed's consolidated and ``zero_to_fp32`` checkpoints, DCP's optimizer state) walks the module
tree, not ``state_dict``. A wrapper holding the MLP as a child adds a level to every such name, and
hiding it in ``state_dict`` by hooks leaves all those paths wrong: adapters were saved without the
MLP's tensors, checkpoints did not load into the untiled model. In place, the module tree, every
name, ``state_dict``, attribute reads and writes (``mlp.down_proj = new``), ``isinstance(mlp,
LlamaMLP)``, ``deepcopy`` and ``pickle`` are those of the untiled module; the tiling lives in one
attribute, ``mlp.tiling``, and ``untile(mlp)`` puts the original class back.

The generated class's ``forward`` is the tiled call: the module's own hooks (a backend's unshard and
reshard, ZeRO-3's gather and release) fire once around it, as untiled, and each shard calls the
original class's forward directly. The call picks the strategy (backend) and the per-shard kernel
(gated fast path or generic), makes a shard plan and runs the shared sharded autograd Function.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from strategies.base import Strategy
from strategies.resolver import StrategyArg, resolve_strategy, strategy_from_arg

from .activations import gated_activation
from .auto_shards import AutoDecision, MLPSize, auto_decision, intermediate_size
from .call_plan import CallPlan, PlanSizes, current_key, shallow_key
from .fast_path import FUSED_EXPERTS, decide_fast_path, structural_decision
from .gated_forms import check_attributes, torch_functions_intact
from .gated_spec import foreign_child_hooks, no_hook_is_backend
from .kernels import GatedShardKernel, GenericShardKernel
from .kernels.generic import generic_layout
from .shard_plan import NumShards, check_num_shards, make_shard_plan
from .sharded_autograd import ShardedRun, sharded_apply
from .tiling_state import STATE_ATTR, TilingState, check_config
from .validation import check_input

_CLASSES: Dict[Tuple[type, type], type] = {}

STATEFUL_ERROR = (
    "TiledMLP: the forward of {module} updated its buffers ({buffers}) in place, which the tiled call would "
    "repeat once per shard and again in the backward recompute (BatchNorm running statistics, spectral_norm's "
    "power iteration). The buffers were put back. Run the module untiled (remove_tiled_mlp / untile), or in "
    "eval mode, where such forwards keep their buffers."
)


def tiled_class(mixin: type, base: type) -> type:
    """The class ``mixin`` + ``base`` (cached), which a tiled module's ``__class__`` is set to."""
    key = (mixin, base)
    cls = _CLASSES.get(key)
    if cls is None:
        name = f"Tiled{base.__name__}"
        signature = _forward_signature(base)
        cls = type(name, (mixin, base), {"_tiled_base": base, "_tiled_mixin": mixin, "__module__": mixin.__module__,
                                         "__qualname__": name, "_tiled_signature": signature,
                                         "forward": TiledForward(signature)})
        _CLASSES[key] = cls
    return cls


def _forward_signature(base: type) -> Optional[inspect.Signature]:
    """The original forward's signature without ``self``: what the tiled forward accepts and shows."""
    try:
        signature = inspect.signature(base.forward)  # type: ignore[attr-defined]  # an nn.Module subclass
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())[1:]
    return signature.replace(parameters=params)


class TiledForward:
    """A tiled class's ``forward``. A *data* descriptor, so the tiled call runs even where another
    library binds a forward on the instance after tiling: ``module.forward = f`` goes to ``__set__``
    and ``f`` becomes what each shard runs; Liger-Kernel writes ``module.__dict__["forward"]``, which a
    data descriptor outranks, and the call adopts it (``TiledMLP._tiled_forward``). Reading it gives
    a method with the original forward's signature (``mlp(hidden_states=h)`` keeps working)."""

    def __init__(self, signature: Optional[inspect.Signature]):
        @torch.compiler.disable
        def forward(module, *args, **kwargs):
            return module._tiled_forward(*args, **kwargs)

        if signature is not None:
            forward.__signature__ = signature.replace(
                parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                            *signature.parameters.values()])
        self.function = forward

    def __get__(self, module, owner=None):
        return self.function if module is None else types.MethodType(self.function, module)

    def __set__(self, module, value) -> None:
        # ``module.forward = module._old_forward`` (accelerate removing its hook; unpickling a bound
        # method) puts the tiled forward itself back: that is no instance forward at all.
        own = isinstance(value, types.MethodType) and value.__self__ is module and value.__func__ is self.function
        module.tiling.instance_forward = None if own else value

    def __delete__(self, module) -> None:
        module.tiling.instance_forward = None


def _rebuild(mixin: type, base: type) -> nn.Module:
    """pickle/deepcopy: an empty instance of the tiled class; its ``__dict__`` is restored after."""
    return object.__new__(tiled_class(mixin, base))


def _own_names(mixin: type) -> List[str]:
    """Names a tiled class adds on top of its base (which must not hide one of the base's)."""
    names: set = set()
    for cls in mixin.__mro__:
        if cls is nn.Module or not issubclass(cls, TiledMLP):
            continue
        names.update(n for n in vars(cls) if not (n.startswith("__") and n.endswith("__")))
    return sorted(names - {"forward", "extra_repr", "_tiled_base", "_tiled_mixin"})


class TiledMLP(nn.Module):
    """Tiles ``mlp`` (``[..., tokens, hidden] -> [..., tokens, out]``, token-wise) in place.

    ``TiledMLP(mlp, ...)`` returns ``mlp`` itself, now also an instance of ``TiledMLP``.

    Args:
        mlp: the module to tile.
        strategy: "auto" (resolved from the runtime at every forward), a registered name, or a
            ``Strategy`` instance.
        num_shards: an int >= 1, or "auto".
        path: "auto" (the gated fast kernel when it provably applies, else generic), "fast", "generic".
        grad_accum_dtype: dtype of the per-parameter gradient sums (default: the parameter's dtype);
            ``torch.float32`` for low-precision parameters.
        use_liger: use Liger-Kernel's Triton activation on CUDA when it is installed.

    What fires how often: hooks on the tiled module itself (a backend's, the user's) fire once per
    call and once around its backward, as untiled. Hooks on its submodules send the call to the
    generic path (the fast kernel calls no submodule), where forward (pre-)hooks fire once per shard
    in the forward and once per shard in the backward recompute, and backward hooks once per shard
    with that shard's gradients. A hook that keeps a tensor it was given (an activation penalty for
    the loss) is an error while a graph is built: that tensor would carry no gradient.
    """

    # Annotation only (no class attribute, so it hides nothing of the tiled module's): the tiling state,
    # set in the instance's __dict__ when it is tiled.
    tiling: TilingState
    _tiled_base: Optional[type] = None  # set on the generated classes: the module's original class
    _tiled_mixin: type  # set on the generated classes: TiledMLP or a subclass of it
    _tiled_signature: Optional[inspect.Signature] = None  # set on the generated classes: the original forward's
    #: Whether the gated fast kernel may ever stand in for this kind of module's forward.
    _tiled_fast_allowed = True

    def __new__(cls, mlp: Optional[nn.Module] = None, strategy: StrategyArg = "auto", num_shards: NumShards = "auto",
                path: str = "auto", grad_accum_dtype: Optional[torch.dtype] = None, use_liger: bool = True):
        if cls._tiled_base is not None:
            # A generated class instantiated directly (``type(tiled)(config)``): a new module of the
            # original class, tiled with the defaults (``__init__`` builds it).
            return object.__new__(cls)
        fixed = prepare_tiling(cls, mlp, strategy, num_shards, path, grad_accum_dtype)
        assert mlp is not None  # prepare_tiling refused anything but a module
        return install_tiling(cls, mlp, TilingState(num_shards, path, grad_accum_dtype, use_liger, fixed))

    def __init__(self, *args, **kwargs):
        if STATE_ATTR in self.__dict__:
            return  # tiled in place by __new__: the module was built long ago
        base: Any = type(self)._tiled_base  # set on every generated class
        base.__init__(self, *args, **kwargs)
        self.__dict__[STATE_ATTR] = TilingState()

    def __reduce_ex__(self, protocol):
        cls = type(self)
        return _rebuild, (cls._tiled_mixin, cls._tiled_base), self.__getstate__()

    # -- configuration ------------------------------------------------------------------------------
    def _tiled_strategy(self) -> Strategy:
        # Not cached: a forward before `fully_shard`, `deepspeed.initialize`, a DDP or an FSDP1 wrap
        # must not pin the single-device fallback (FSDP1 would then lose every gradient silently).
        state: TilingState = self.tiling
        if state.fixed_strategy is not None:
            return state.fixed_strategy
        in_backward = _inside_backward()
        if in_backward and state.forward_strategy is not None:
            # A call inside a backward is a checkpoint recomputing a forward made outside it, where the
            # backend's context was visible (DDP is seen only while its forward runs): the same backend.
            return state.forward_strategy
        strategy = resolve_strategy(self, state.ancestors())
        if not in_backward:
            state.forward_strategy = strategy
        return strategy

    def extra_repr(self) -> str:
        state: TilingState = self.tiling
        strategy = state.fixed_strategy.name if state.fixed_strategy else "auto"
        mine = f"tiled: num_shards={state.num_shards!r}, path={state.path!r}, strategy={strategy!r}"
        base = super().extra_repr()
        return f"{base}, {mine}" if base else mine

    # -- forward ---------------------------------------------------------------------------------------
    # The generated class's ``forward`` (``TiledForward``) calls this; torch.compile of a surrounding
    # model runs it eagerly (the shard loop and the RNG capture are not traceable, and tracing into
    # them only produced a graph break at each).
    def _tiled_forward(self, *args, **kwargs) -> torch.Tensor:
        if self.tiling.shard_depth:
            # Called from inside one of its own shards: an instance forward wrapping the tiled forward
            # (accelerate's hooks: ``old = m.forward; m.forward = wrapper(old)``) reaches here; the
            # shard computes the module's own forward.
            return self._tiled_base_forward()(self, *args, **kwargs)
        self._tiled_adopt_instance_forward()
        x = args[0] if len(args) == 1 and not kwargs else self._tiled_input(args, kwargs)
        return self._tiled_call(x, self._tiled_original_forward, check_hidden=True)

    def _tiled_adopt_instance_forward(self) -> None:
        # A forward written into the instance's __dict__ after tiling (Liger's _bind_method_to_module):
        # it is what the module computes now, so each shard runs it; untiling puts it back.
        # An instance forward that is the tiled forward itself (unpickled ``getattr(module, "forward")``)
        # is dropped by the same rule.
        installed = self.__dict__.pop("forward", None)
        if installed is None:
            installed = self.tiling.instance_forward
        if installed is not None:
            _tiled_forward_descriptor(type(self)).__set__(self, installed)

    def _tiled_input(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The hidden states, passed by position or by the original forward's name for them."""
        installed = self.tiling.instance_forward
        signature = inspect.signature(installed) if installed is not None else type(self)._tiled_signature
        if signature is None:
            raise TypeError(f"{type(self).__name__}: pass the hidden states as the one positional argument")
        bound = signature.bind(*args, **kwargs)  # the TypeError untiled would raise, for a wrong call
        (name, x), *rest = bound.arguments.items()
        if rest:
            raise TypeError(
                f"{type(self).__name__}.forward was given {', '.join(n for n, _ in rest)} besides {name}: the tiled call "
                "passes the hidden states alone to each shard. Call it with the hidden states only, or untile it")
        return x

    def _tiled_original_forward(self, *args: torch.Tensor) -> torch.Tensor:
        """The module's own forward, without hooks: what one shard runs."""
        state: TilingState = self.tiling
        installed = state.instance_forward
        if installed is None:
            return self._tiled_base_forward()(self, *args)
        state.shard_depth += 1
        try:
            return installed(*args)
        finally:
            state.shard_depth -= 1

    def _tiled_base_forward(self) -> Callable:
        """The original class's forward function, looked up now (a forward patched on the class counts)."""
        return type(self)._tiled_base.forward  # type: ignore[union-attr]

    def _tiled_call(self, x: torch.Tensor, shard_forward: Callable, check_hidden: bool,
                    riders: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """The tiled call of ``shard_forward`` over ``x``; ``riders`` are other token-wise inputs of any
        dtype (``[..., tokens, ...]``, the leading dims of ``x``), sliced like it and passed after it to
        each shard (the generic kernel only)."""
        state: TilingState = self.tiling
        check_num_shards(state.num_shards)
        check_input(x, self if check_hidden else None)
        flat_riders = _flat_riders(x, riders) if riders else ()
        strategy = self._tiled_strategy()
        strategy.check_supported(self)
        state.last_strategy = strategy
        with strategy.gathered(self):
            call = self._tiled_decision(strategy, x, shard_forward, flat_riders)
            if call.kernel is None:
                # Nothing to split, or too short for tiling to lower the peak: the plain module (only where
                # the backend allows it: the same collectives as a tiled call). Only the plan's sizes are
                # kept (``PlanSizes``): no tensor of the module is held by the cache of its short calls.
                if state.call_plan is not None:
                    state.call_sizes, state.call_plan = state.call_plan.sizes(), None
                state.last_path, state.last_num_shards, state.last_reason = "untiled", 1, call.reason
                return shard_forward(x, *riders)
            plan, kernel = call.plan, call.kernel
            assert plan is not None and call.num_shards is not None
            generic = isinstance(kernel, GenericShardKernel)
            shard_plan = make_shard_plan(x.numel() // x.shape[-1], call.num_shards)
            run = ShardedRun(
                kernel=kernel,
                plan=shard_plan,
                gathered=lambda: strategy.gathered(self),
                grad_accum_dtype=state.grad_accum_dtype,
                # The fast path provably draws no random numbers, so it has none to replay.
                replay_rng=generic,
                param_mask=_membership(kernel.params, plan.trainable),  # the generic kernel's: all
                zeros_for_unused=strategy.unused_grads_as_zeros,
                deliver_grads=strategy.deliver_grads,
                params_swap_storage=strategy.swaps_param_storage(self),
            )
            with _buffers_kept(self, plan.named_buffers):
                out = sharded_apply(x, run)
        state.call_sizes = plan.sizes()
        state.last_path = "generic" if generic else "fast"
        state.last_num_shards = shard_plan.num_shards
        state.last_reason = call.reason
        return out

    def _tiled_decision(self, strategy: Strategy, x: torch.Tensor, shard_forward: Callable,
                        riders: Sequence[torch.Tensor]) -> CallDecision:
        """What this call runs, decided once (inside the strategy's gathered region, where the fast-path
        decision can read the parameters): untiled with a reason, or a kernel and a shard count.

        The auto policy's answer is sought from the cheapest evidence first, each step needed only when
        the one before did not settle it: the last plan's sizes while a shallow key holds (no walk of the
        module, ``call_plan.py``); this plan's sizes under the fast path's rule (the generic path only
        needs more tokens, so a call too short for the fast path is too short for both, and no kernel is
        chosen for it); then the chosen kernel's rule."""
        state: TilingState = self.tiling
        num_tokens = x.numel() // x.shape[-1]
        may_pass = strategy.allows_untiled_call(self)
        last = state.call_sizes
        if may_pass and last is not None and last.shallow == shallow_key(self, strategy, x):
            decision = self._tiled_shards(last, x, num_tokens, generic=last.generic)
            if decision.num_shards is None:
                return CallDecision(decision.reason)
        plan = self._tiled_plan(strategy, x)
        if may_pass:
            decision = self._tiled_shards(plan, x, num_tokens, generic=False)
            if num_tokens == 0 or decision.num_shards is None:
                return CallDecision(decision.reason if num_tokens else "untiled: no tokens")
        kernel = self._tiled_kernel(strategy, plan, shard_forward, x, riders)
        generic = isinstance(kernel, GenericShardKernel)
        decision = self._tiled_shards(plan, x, num_tokens, generic)
        reason, num_shards = decision.reason, decision.num_shards
        if may_pass and num_shards is None:
            return CallDecision(reason)
        if num_tokens == 0 or num_shards is None:
            num_shards = 1  # the backend needs every rank on the tiled path (same collectives)
            reason += f"; run as one shard: {strategy.name} needs every rank on the tiled path"
        if generic:
            reason += f"; generic path: {plan.fast[1] if plan.fast else 'path=generic'}"
        return CallDecision(reason, plan, kernel, num_shards)

    def _tiled_shards(self, sizes: Union[PlanSizes, CallPlan], x: torch.Tensor, num_tokens: int,
                      generic: bool) -> AutoDecision:
        """The configured count, or the auto policy's (``num_shards`` None: run untiled), and why, from a
        plan's sizes (the plan itself, or the sizes a passed-through call kept)."""
        num_shards = self.tiling.num_shards
        if isinstance(num_shards, int):
            return AutoDecision(num_shards, f"tiled: num_shards={num_shards} as configured")
        trainable_bytes = sizes.trainable_bytes if generic else None
        size = MLPSize(x.shape[-1], sizes.intermediate, sizes.param_bytes, x.element_size(), trainable_bytes)
        return auto_decision(num_tokens, size)

    def _tiled_plan(self, strategy: Strategy, x: torch.Tensor) -> CallPlan:
        """The cached plan while its key holds, else a new one (see ``call_plan.py``)."""
        state: TilingState = self.tiling
        forward = state.instance_forward if state.instance_forward is not None else self._tiled_base_forward()
        key, keep_alive = current_key(self, strategy, x, forward)
        plan = state.call_plan
        if plan is None or plan.key != key:
            plan = CallPlan(key, keep_alive, shallow_key(self, strategy, x), strategy.trainable_params(self),
                            intermediate_size(self), strategy.param_bytes(self), list(self.named_buffers()))
            state.call_plan = plan
        return plan

    def _tiled_kernel(self, strategy: Strategy, plan: CallPlan, shard_forward: Callable, x: torch.Tensor,
                      riders: Sequence[torch.Tensor] = ()):
        state: TilingState = self.tiling
        if plan.fast is None or _fast_decision_stale(self, plan):
            plan.fast = self._tiled_fast_spec(strategy, x)
            plan.fast_kernel = None
        spec, why_not = plan.fast
        if spec is not None:
            assert not riders, "the gated fast kernel takes no other sharded input"
            if plan.fast_kernel is None:  # stateless: one per plan
                plan.fast_kernel = GatedShardKernel(spec, gated_activation(spec.activation, x.device, state.use_liger),
                                                    type(self).__name__)
            return plan.fast_kernel
        if state.path == "fast":
            raise _fast_refused(self, why_not)
        hooks = functools.partial(foreign_child_hooks, self, strategy.is_backend_hook)
        if plan.generic_layout is None:
            plan.generic_layout = generic_layout(self, plan.trainable, hooks(), state.instance_forward)
        prefix = (1,) * (x.dim() - 2)
        return GenericShardKernel(shard_forward, type(self).__name__, plan.trainable, prefix, plan.generic_layout, hooks,
                                  grad_mode=torch.is_grad_enabled(), riders=riders)

    def _tiled_fast_spec(self, strategy: Strategy, x: torch.Tensor):
        """(the gated spec, "") when the fast kernel provably computes this call, else (None, why not)."""
        if self.tiling.path == "generic":
            return None, "path='generic' was asked for"
        if not self._tiled_fast_allowed:
            return None, FUSED_EXPERTS
        return decide_fast_path(self, self._tiled_forward_function(), x, strategy.is_backend_hook)

    def _tiled_forward_function(self) -> Optional[Callable]:
        """The plain function the module's forward runs now, where it is a function *of this module*:
        the class's forward, or an instance forward bound to this very module. None for anything else
        (a method of another module, a wrapper, a plain function): no form can be proven for it."""
        installed = self.tiling.instance_forward
        if installed is None:
            return self._tiled_base_forward()
        if isinstance(installed, types.MethodType) and installed.__self__ is self:
            return installed.__func__
        return None


@dataclass(frozen=True)
class CallDecision:
    """One call's decision, made once (``TiledMLP._tiled_decision``): no kernel means run untiled."""

    reason: str
    plan: Optional[CallPlan] = None
    kernel: Optional[Any] = None  # a ``GatedShardKernel`` or ``GenericShardKernel``
    num_shards: Optional[int] = None


def _fast_decision_stale(module: TiledMLP, plan: CallPlan) -> bool:
    """Whether a cached fast decision may no longer hold. The key names objects by identity, the forward's
    code included; a class attribute added since (``MyMLP.up_proj = property(...)``) changes what the
    forward reads without changing any of them."""
    spec = plan.fast[0] if plan.fast is not None else None
    if spec is None:
        return False
    return not torch_functions_intact() or bool(check_attributes(module, spec.form))


class FastPathRefused(ValueError):
    """``path="fast"`` asked of a module the fast kernel cannot run (a ValueError, as any bad setting)."""


def _fast_refused(module: nn.Module, why_not: str) -> FastPathRefused:
    return FastPathRefused(f"path='fast' cannot apply to {type(module).__name__}: {why_not}; use path='auto'")


def _flat_riders(x: torch.Tensor, riders: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each rider as ``[tokens, ...]`` (a view where its layout allows), checked against ``x``'s tokens."""
    lead = x.shape[:-1]
    flat = []
    for rider in riders:
        if tuple(rider.shape[:len(lead)]) != tuple(lead):
            raise ValueError(f"a sharded input of shape {tuple(rider.shape)} does not share the leading (token) dims "
                             f"{tuple(lead)} of the hidden states {tuple(x.shape)}")
        flat.append(rider.reshape(-1, *rider.shape[len(lead):]))
    return flat


def _membership(tensors: Sequence[torch.Tensor], chosen: Sequence[torch.Tensor]) -> List[bool]:
    ids = {id(t) for t in chosen}
    return [id(t) in ids for t in tensors]


@contextlib.contextmanager
def _buffers_kept(module: nn.Module, buffers: Sequence[Tuple[str, torch.Tensor]]) -> Iterator[None]:
    """Refuse a forward that updates one of its ``buffers`` (the module's, named): put them back and
    raise, also when the forward failed for another reason. Compared by value as well as by version
    counter: BatchNorm's kernels update ``running_mean``/``running_var`` without bumping the version."""
    if not buffers:
        yield
        return
    versions = [b._version for _, b in buffers]
    saved = [b.detach().clone() for _, b in buffers]
    moved: List[int] = []
    try:
        yield
    finally:
        moved = [i for i, (_, b) in enumerate(buffers)
                 if b._version != versions[i] or not torch.equal(b.detach(), saved[i])]
        if moved:
            with torch.no_grad():
                for i in moved:
                    buffers[i][1].copy_(saved[i])
    if moved:
        names = ", ".join(buffers[i][0] for i in moved)
        raise RuntimeError(STATEFUL_ERROR.format(module=type(module).__name__, buffers=names))


# -- tiling and untiling in place --------------------------------------------------------------------------
def prepare_tiling(mixin: type, mlp: Optional[nn.Module], strategy: StrategyArg, num_shards: NumShards, path: str,
                   grad_accum_dtype, ancestors: Sequence[nn.Module] = ()) -> Optional[Strategy]:
    """Every check made before ``mlp`` is changed; returns the fixed strategy (None for "auto")."""
    if not isinstance(mlp, nn.Module):
        raise TypeError(f"TiledMLP tiles an nn.Module, got {type(mlp).__name__}")
    if isinstance(mlp, TiledMLP):
        raise TypeError(f"this {type(mlp).__name__} is already tiled; untile it first to change its tiling")
    check_config(num_shards, path, grad_accum_dtype)
    fixed = strategy_from_arg(strategy)
    problem = _shadow_problem(mixin, mlp)
    if problem:
        raise TypeError(f"cannot tile {type(mlp).__name__} in place: {problem}")
    # Reject what is already known to be unsupported (FSDP1, per-Linear FSDP2) now; "auto" is
    # resolved again at every forward, since the model is usually wrapped after it is tiled.
    resolved = fixed or resolve_strategy(mlp, ancestors)
    resolved.check_supported(mlp)
    if path == "fast":
        why_not = fast_path_problem(mixin, mlp, resolved.is_backend_hook)
        if why_not:
            raise _fast_refused(mlp, why_not)
    return fixed


def fast_path_problem(mixin: type, mlp: nn.Module, is_backend_hook: Callable = no_hook_is_backend) -> str:
    """Why the fast kernel could never run ``mlp`` (tiled or not), whatever the call ("" when it may)."""
    if not getattr(mixin, "_tiled_fast_allowed", True):
        return FUSED_EXPERTS
    if isinstance(mlp, TiledMLP):
        forward = mlp._tiled_forward_function()
    else:  # not tiled yet: an instance forward here is another library's (accelerate's hooks)
        forward = None if "forward" in mlp.__dict__ else type(mlp).forward
    return structural_decision(mlp, forward, is_backend_hook)[1]


def _shadow_problem(mixin: type, mlp: nn.Module) -> str:
    taken = [n for n in (STATE_ATTR, *_own_names(mixin)) if hasattr(mlp, n) or n in mlp.__dict__]
    if taken:
        return f"it already has attributes named {taken}, which tiling would hide"
    return ""


def _tiled_forward_descriptor(cls: type) -> TiledForward:
    for klass in cls.__mro__:
        found = vars(klass).get("forward")
        if isinstance(found, TiledForward):
            return found
    raise TypeError(f"{cls.__name__} has no tiled forward")


def _inside_backward() -> bool:
    """Whether this thread is running an autograd backward (a checkpoint's recompute runs inside one)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def install_tiling(mixin: type, mlp: nn.Module, state: TilingState) -> TiledMLP:
    """Make ``mlp`` tiled (checks done by ``prepare_tiling``); returns it."""
    # An instance forward would hide the tiled class's forward: it becomes what each shard runs.
    state.instance_forward = mlp.__dict__.pop("forward", None)
    mlp.__class__ = tiled_class(mixin, type(mlp))
    mlp.__dict__[STATE_ATTR] = state
    assert isinstance(mlp, TiledMLP)
    return mlp


def untile(module: nn.Module) -> nn.Module:
    """Put the original class back and drop the tiling: the exact module that was tiled."""
    base = type(module).__dict__.get("_tiled_base")
    if base is None:
        if isinstance(module, TiledMLP):
            raise TypeError(
                f"{type(module).__name__} was wrapped again after it was tiled (fully_shard?); "
                "untile before such wrapping")
        raise TypeError(f"{type(module).__name__} is not tiled")
    state = module.__dict__.pop(STATE_ATTR)
    module.__class__ = base
    if state.instance_forward is not None:
        module.__dict__["forward"] = state.instance_forward
    return module
