"""The one tiled call: a tiled module's forward (``module_forward``) and the tiled loss (``tiled_call``).

    strategy  ->  gathered region  ->  decision  ->  shard plan  ->  map or reduce run

What a module's call runs is decided at its first call and kept in a ``MapPlan``; each later call checks, by
identity, only what a training step can change (docs/architecture.md). Strict mode (``strict.py``) checks more.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as _nn_module
from torch.utils.hooks import RemovableHandle

from tiled_mlp.strategies.base import Strategy, check_declarations
from tiled_mlp.strategies.resolver import registrations_by_priority, resolve_strategy

from . import auto_shards as _auto_shards
from . import kernel_registry as _kernels
from . import strict as _strict
from .auto_shards import AutoDecision, intermediate_size, remembered_auto_decision
from .buffer_guard import buffers_kept
from .fast_path import fast_refused
from .gated_spec import GLOBAL_HOOK_DICTS, MODULE_HOOK_DICTS
from .kernel_registry import MAP, KernelCall, available_kernels, choose_kernel
from .module_forward import ShardForward, adopt_instance_forward, base_forward, hidden_states_argument
from .shard_plan import make_shard_plan
from .sharded_autograd import AutocastState, ShardedRun, sharded_apply
from .tiling_state import STATE_ATTR, TilingState
from .validation import check_input, expected_hidden_size


class TiledInputs(NamedTuple):
    """How one call's arguments enter the tiled call (``TiledMLP.tiled_inputs`` returns it)."""

    hidden_states: torch.Tensor  # ``[..., tokens, hidden]``, sharded over its tokens
    # Other token-wise inputs (a MoE block's routing), sliced like the hidden states, passed after them.
    token_inputs: Sequence[torch.Tensor] = ()
    # Whether the hidden states must match the module's input width (a module with input projections).
    check_hidden: bool = True


def default_tiled_inputs(module: nn.Module, *args, **kwargs) -> TiledInputs:
    x = args[0] if len(args) == 1 and not kwargs else hidden_states_argument(module, args, kwargs)
    return TiledInputs(x)


@dataclass(frozen=True)
class CallDecision:
    """One call's decision, made inside the gathered region: no kernel means run untiled."""

    reason: str
    kernel: Optional[Any] = None  # a ``ShardKernel`` (map) or ``ReduceKernel`` (reduce)
    kernel_name: str = "untiled"
    num_tokens: int = 0
    num_shards: Optional[int] = None
    trainable: Sequence[torch.Tensor] = ()  # the parameters owed a gradient
    # The runs made for this decision, by the call settings they also depend on (``_run_for``).
    runs: Dict[tuple, ShardedRun] = field(default_factory=dict, compare=False, repr=False)


# -- strategies ----------------------------------------------------------------------------------------

def autograd_carries_the_call(strategy: Strategy) -> bool:
    """Whether autograd alone carries a call's tensors and gradients, as for any op (what a custom op needs)."""
    return not strategy.gathers_params and not strategy.delivers_grads


_DISTRIBUTED = dist.is_available()
_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def module_strategy(module: nn.Module, state: TilingState) -> Strategy:
    """The fixed strategy, or "auto" resolved now. Not kept across calls where a process group is initialised:
    a forward before ``fully_shard``, ``deepspeed.initialize`` or a DDP wrap must not pin the single-device fallback."""
    fixed = state.fixed_strategy
    if fixed is not None:
        return fixed
    fields = state.__dict__
    distributed = _DISTRIBUTED and dist.is_initialized()
    if not distributed:
        kept = fields.get("local_strategy")
        if kept is not None and kept[1] is registrations_by_priority():  # a new object at every registry change
            return kept[0]
    in_backward = _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1
    if in_backward and state.forward_strategy is not None:
        # A checkpoint recomputing a forward made where the backend's context was visible (DDP's forward).
        return state.forward_strategy
    strategy = resolve_strategy(module, state.ancestors() if state.ancestor_refs else ())
    if not in_backward:
        # Into the state's dict: not a setting that ``TilingState.__setattr__`` checks.
        fields["forward_strategy"] = strategy
    # Kept only where built from its registered arguments alone and no process group can change what claims the module.
    registrations = None if distributed else registrations_by_priority()
    own_build = type(strategy).configures_from_runtime
    fields["local_strategy"] = None if own_build or not registrations else (strategy, registrations)
    return strategy


# -- what a module's call rests on -------------------------------------------------------------------------

_REGISTRIES = ("_parameters", "_buffers", "_modules")
_GLOBAL_HOOK_DICTS = tuple(getattr(_nn_module, name) for name in GLOBAL_HOOK_DICTS
                           if isinstance(getattr(_nn_module, name, None), dict))
# A parameter's device is not read: the input's is part of ``call_config``, and the module's own run needs them alike.
_tensor_state = operator.attrgetter("dtype", "requires_grad")
_dict_of = operator.attrgetter("__dict__")
_END = object()  # closes the identity sequence: a value removed or added anywhere shifts it
# Registrations through ``nn.Module``'s API anywhere (``register_parameter``, ``add_module``, ``setattr`` of a
# Parameter, Module or Buffer), counted by torch's global registration hooks from the first plan on.
_REGISTERED = [0]


def _count_registration(module: nn.Module, name: str, value: Any) -> None:
    # Not where Dynamo traces (a ModuleList sliced in a compiled forward registers): the count would become a
    # guard that fails at every call.
    if not torch.compiler.is_compiling():
        _REGISTERED[0] += 1


@functools.cache
def count_registrations() -> None:
    """Install the counter (once, when a module is tiled: installed during a trace, it would make the trace run a
    hook the trace before it did not)."""
    for register in (_nn_module.register_module_parameter_registration_hook,
                     _nn_module.register_module_buffer_registration_hook,
                     _nn_module.register_module_module_registration_hook):
        register(_count_registration)


class ModuleTree:
    """The module tree below (and including) one module as it is now, compared at each call in C-level passes
    (no Python frame per module): classes and their forwards, instance forwards and training modes and the
    tensors' states by equality; each module's ``__dict__`` and the values of its registries and hook dicts by
    identity (not the registry dicts themselves: one replaced wholesale is seen in strict mode only).
    Names and hooks are read again only after they may have changed: registry keys after a registration through
    ``nn.Module``'s API anywhere, hook keys (global and per module) after a hook took the next handle id. A value
    or a hook removed is seen by identity; a key renamed by writing into a registry directly, keeping its values
    in order, is seen in strict mode only. ``deep`` (strict mode): every attribute of every module by name and
    identity as well, and the keys at every call.

    The root and its ``__dict__`` are not held (their dict by id, the root given at each check): the tree lives in
    the root's own state, and holding them would make a reference cycle that keeps a deleted model's memory
    until the garbage collector runs."""

    __slots__ = ("root_dict", "root_class", "root_training", "watched", "watched_values", "root_items", "modules",
                 "dicts", "read_dicts", "read_keys", "registries", "keys", "tensors", "hook_dicts", "hooks", "hook_id",
                 "registered", "reading", "values", "empty", "objects")

    def __init__(self, module: nn.Module, deep: bool):
        count_registrations()
        modules: List[nn.Module] = []
        registries: List[dict] = []
        hook_dicts: List[dict] = list(_GLOBAL_HOOK_DICTS)
        stack = [module]
        while stack:
            sub = stack.pop()
            d = sub.__dict__
            modules.append(sub)
            if deep and sub is not module:
                registries.append(d)
            registries.extend(d[name] for name in _REGISTRIES)
            hook_dicts.extend(d.get(name, {}) for name in MODULE_HOOK_DICTS)
            stack.extend(child for child in d["_modules"].values() if child is not None)
        root = module.__dict__
        self.root_dict = id(root)
        self.root_class = type(module)
        self.root_training = root["training"]
        # Values a kernel's decision read (``watch``): (the child's dict, or None for the root's; attribute).
        self.watched: Tuple[Tuple[Optional[dict], str], ...] = ()
        self.watched_values: tuple = ()
        # Strict mode: the root's attributes but its state (which holds this tree).
        self.root_items = _root_items(root) if deep else None
        self.modules = tuple(modules[1:])
        self.dicts = tuple(map(_dict_of, self.modules))
        # Each child's training mode and instance forward (the root's forward is ``call_config``'s).
        self.read_dicts = self.dicts * 2
        self.read_keys = ("training",) * len(self.modules) + ("forward",) * len(self.modules)
        self.registries = tuple(registries)
        self.keys = tuple(map(tuple, self.registries))
        self.tensors = tuple(t for d in (root, *self.dicts) for t in (*d["_parameters"].values(),
                                                                        *d["_buffers"].values()) if t is not None)
        self.hook_dicts = tuple(hook_dicts)
        self.hooks = tuple(map(tuple, self.hook_dicts))
        self.hook_id = None if deep else RemovableHandle.next_id
        self.registered = None if deep else _REGISTERED[0]
        self.reading = self._read()
        held = (*self.registries, *self.hook_dicts)
        self.values = tuple(d.values() for d in held if d)
        self.empty = tuple(d for d in self.registries if not d)  # one filled by a direct write is seen by its size
        self.objects = (*self.dicts, *itertools.chain.from_iterable(self.values), _END)

    def watch(self, root: nn.Module, reads: Sequence[Tuple[str, str]]) -> None:
        """Plain values a kernel's decision read ((child's name, or "" for the root; attribute)): the tree holds
        while each is the same (a named scale, the attribute choosing an activation)."""
        children = root.__dict__["_modules"]
        self.watched += tuple((children[child].__dict__ if child else None, key) for child, key in reads)
        self.watched_values = self._watched_now(root.__dict__)

    def _watched_now(self, root_dict: dict) -> tuple:
        # With their types: a float scale rebound to an equal tensor is another computation.
        values = [(root_dict if owner is None else owner).get(key) for owner, key in self.watched]
        return tuple(zip(map(type, values), values, strict=True))

    def _read(self) -> tuple:
        classes = tuple(map(type, self.modules))
        return (classes, tuple(map(getattr, classes, itertools.repeat("forward"))),
                tuple(map(dict.get, self.read_dicts, self.read_keys)), tuple(map(_tensor_state, self.tensors)))

    def holds(self, root: nn.Module) -> bool:
        # Tuples compare their items by identity first (classes, functions, bound methods).
        if self.hook_id != RemovableHandle.next_id:
            if tuple(map(tuple, self.hook_dicts)) != self.hooks:
                return False
            if self.hook_id is not None:
                self.hook_id = RemovableHandle.next_id
        if self.registered != _REGISTERED[0]:
            if tuple(map(tuple, self.registries)) != self.keys:
                return False
            if self.registered is not None:
                self.registered = _REGISTERED[0]
        d = root.__dict__
        if self.root_items is not None and not _same_items(_root_items(d), self.root_items):
            return False
        return (id(d) == self.root_dict and type(root) is self.root_class and d["training"] == self.root_training
                and (not self.watched or self._watched_now(d) == self.watched_values)
                and self._read() == self.reading and not any(map(len, self.empty))
                and all(map(operator.is_, itertools.chain(map(_dict_of, self.modules),
                                                          itertools.chain.from_iterable(self.values), (_END,)),
                            self.objects)))


def _root_items(root_dict: dict) -> tuple:
    return tuple((name, value) for name, value in root_dict.items() if name != STATE_ATTR)


def _same_items(now: tuple, then: tuple) -> bool:
    return len(now) == len(then) and all(a[0] == b[0] and a[1] is b[1] for a, b in zip(now, then, strict=True))


def call_config(module: nn.Module, state: TilingState, strategy: Strategy, x: torch.Tensor,
                token_inputs: Sequence[torch.Tensor]) -> tuple:
    installed = state.instance_forward
    forward = installed if installed is not None else type(module)._tiled_base.forward  # type: ignore[attr-defined]  # ``base_forward``
    device = x.device
    # The module's class is the tree's; setting a path or the fused kernel drops the plan (``TilingState``). The
    # autocast state last: the plan's runs carry it (``MapPlan.autocast``).
    return (type(strategy), forward, getattr(forward, "__code__", None),  # a method reads its function's
            x.dtype, device, x.dim(), not token_inputs, _kernels.GENERATION[0], AutocastState.capture(device))


class MapPlan:
    """What a module's calls rest on, kept while ``config`` and ``tree`` hold; kernels keep their state here."""

    def __init__(self, module: nn.Module, strategy: Strategy, config: tuple, trainable: List[torch.Tensor]):
        self.config = config
        self.autocast: AutocastState = config[-1]
        self.tree = ModuleTree(module, deep=_strict.ON)
        self.strategy = strategy  # the instance the plan was checked with (``check_supported``)
        self.trainable = trainable
        self.hidden = expected_hidden_size(module)
        self.intermediate = intermediate_size(module)
        self.param_bytes = strategy.param_bytes(module)
        self.allows_untiled = strategy.allows_untiled_call(module) and not strategy.delivers_grads
        self.swaps = strategy.swaps_param_storage(module)
        self.named_buffers = list(module.named_buffers())
        self.shard_forward = ShardForward(module)  # what one shard of a call runs
        # The kernels' per-plan state (``builtin_kernels``, ``kernel_registry``).
        self.fast: Optional[tuple] = None
        self.fast_kernel: Any = None
        self.kernel_cache: Dict[str, Any] = {}
        self.choices: Dict[tuple, Any] = {}
        # Checked in strict mode only (the fast path's decision again); given the module, so that they do not hold it.
        self.guards: List[Callable[[nn.Module], bool]] = []
        self.generic = False  # whether the last kernel chosen keeps gradient buffers of its own
        self.views: Dict[type, Any] = {}  # the strategy's local view, by kernel class (None: plain tensors)
        # Tiled decisions of kernels that serve many calls, by (tokens, shard setting, policy).
        self.decisions: Dict[tuple, CallDecision] = {}
        self._trainable_bytes: Optional[int] = None

    def add_guards(self, *guards: Callable[[nn.Module], bool]) -> None:
        self.guards.extend(guards)

    @property
    def trainable_bytes(self) -> int:
        if self._trainable_bytes is None:
            self._trainable_bytes = sum(p.numel() * p.element_size() for p in self.trainable)
        return self._trainable_bytes

    def holds(self, config: tuple, module: nn.Module) -> bool:
        if self.config != config or not self.tree.holds(module):
            return False
        return not _strict.ON or all(guard(module) for guard in self.guards)


def current_plan(module: nn.Module, state: TilingState, strategy: Strategy, x: torch.Tensor,
                 token_inputs: Sequence[torch.Tensor] = ()) -> MapPlan:
    config = call_config(module, state, strategy, x, token_inputs)
    plan = state.call_plan
    if plan is not None and plan.holds(config, module):
        if plan.strategy is not strategy:  # a strategy built anew for this call (DDP's, from its wrapper)
            strategy.check_supported(module)
        return plan
    check_declarations(strategy)  # an instance may override what its class declares
    strategy.check_supported(module)
    plan = MapPlan(module, strategy, config, strategy.trainable_params(module))
    state.__dict__["call_plan"] = plan
    return plan


# -- the decision ------------------------------------------------------------------------------------------

def decide_map_call(module: nn.Module, state: TilingState, strategy: Strategy, x: torch.Tensor,
                    token_inputs: Sequence[torch.Tensor], compiling: bool = False) -> CallDecision:
    """What this call of ``module`` on ``x`` runs (inside the strategy's gathered region)."""
    return _decide(module, state, current_plan(module, state, strategy, x, token_inputs), strategy, x, token_inputs,
                   compiling)


_DECISIONS_LIMIT = 64  # per plan: varying sequence lengths (packing, padding-free batches) make one per step


def _decide(module: nn.Module, state: TilingState, plan: MapPlan, strategy: Strategy, x: torch.Tensor,
            token_inputs: Sequence[torch.Tensor], compiling: bool = False) -> CallDecision:
    num_tokens = x.numel() // x.shape[-1]
    configured = state.num_shards
    # Compiling is part of the key: the auto policy passes a launch-bound call through under torch.compile only.
    memo_key = (num_tokens, configured, _auto_shards.policy_inputs(_auto_shards) if not isinstance(configured, int) else None,
                compiling)
    decision = plan.decisions.get(memo_key)
    if decision is None:
        decision, keep = _decide_now(module, state, plan, strategy, x, token_inputs, num_tokens, compiling)
        if keep:
            if len(plan.decisions) >= _DECISIONS_LIMIT:
                plan.decisions.clear()
            plan.decisions[memo_key] = decision
    return decision


def _decide_now(module: nn.Module, state: TilingState, plan: MapPlan, strategy: Strategy, x: torch.Tensor,
                token_inputs: Sequence[torch.Tensor], num_tokens: int, compiling: bool) -> Tuple[CallDecision, bool]:
    by_policy = not isinstance(state.num_shards, int)
    # A configured count never passes a call through for its length: only the auto policy asks the sizes.
    untiled_allowed = (by_policy or num_tokens == 0) and plan.allows_untiled
    if untiled_allowed and num_tokens == 0:
        return CallDecision("untiled: no tokens"), True
    if untiled_allowed and by_policy:
        # The fast kernel's rule first: every other kernel only needs more tokens.
        auto = shard_count(state, plan, x, num_tokens, False, compiling)
        if auto.num_shards is None:
            return CallDecision(auto.reason), True
    only = None if state.path == "auto" else state.path
    call = KernelCall(module, x, strategy, plan.trainable, plan.shard_forward, token_inputs, cache=plan)
    choice = choose_kernel(MAP, call, only)
    if choice.entry is None:
        if state.path == "fast":
            raise fast_refused(module, dict(choice.declined).get("fast", "it declined"))
        if only is not None and only not in dict(choice.declined):
            raise RuntimeError(f"TiledMLP: path={only!r} names no registered kernel now (unregistered after tiling?); "
                               f"registered: {available_kernels(MAP)}. Register it again, or set tiling.path")
        raise RuntimeError(f"TiledMLP: no registered kernel runs {type(module).__name__}: {choice.describe()}")
    # Kept only where the registry kept the choice with the plan: a kernel built for one call holds what it read.
    keep = any(kept is choice for kept in plan.choices.values())
    plan.generic = choice.entry.keeps_grad_buffers
    auto = shard_count(state, plan, x, num_tokens, plan.generic, compiling)
    reason, num_shards = auto.reason, auto.num_shards
    if untiled_allowed and num_shards is None:
        return CallDecision(reason), keep
    if num_tokens == 0 or num_shards is None:
        num_shards = 1  # the backend needs every rank on the tiled path (same collectives)
        reason += f"; run as one shard: {strategy.name} needs every rank on the tiled path"
    return CallDecision(f"{reason}; {choice.describe()}", choice.kernel, choice.name, num_tokens, num_shards,
                        plan.trainable), keep


def shard_count(state: TilingState, sizes: Any, x: torch.Tensor, num_tokens: int, generic: bool,
                compiling: bool) -> AutoDecision:
    num_shards = state.num_shards
    if isinstance(num_shards, int):
        return AutoDecision(num_shards, f"tiled: num_shards={num_shards} as configured")
    trainable_bytes = sizes.trainable_bytes if generic else None
    return remembered_auto_decision(num_tokens, x.shape[-1], sizes.intermediate, sizes.param_bytes, x.element_size(),
                                    trainable_bytes, _auto_shards.device_class(x.device), compiling)


# -- a tiled module's call -----------------------------------------------------------------------------------

def module_forward(module: nn.Module, *args, **kwargs) -> torch.Tensor:
    fields = module.__dict__
    state: TilingState = fields["tiling"]
    if state.shard_depth:
        # From inside one of its own shards: an instance forward wrapping the tiled forward (accelerate's hooks).
        return base_forward(module)(module, *args, **kwargs)
    if "forward" in fields:
        adopt_instance_forward(module, state)
    tiled_inputs = type(module).tiled_inputs  # type: ignore[attr-defined]  # TiledMLP's
    if tiled_inputs is default_tiled_inputs and len(args) == 1 and not kwargs:
        x, token_inputs, check_hidden = args[0], (), True
    else:
        x, token_inputs, check_hidden = tiled_inputs(module, *args, **kwargs)
    plan = state.call_plan
    if (plan is None or type(x) is not torch.Tensor or x.dim() < 2 or not x.is_floating_point()
            or (check_hidden and plan.hidden is not None and x.shape[-1] != plan.hidden)):
        # A bad call is refused before any work (the plan's width may be stale: checked again below).
        check_input(x, module if check_hidden else None)
    flat_inputs = _flat_token_inputs(x, token_inputs) if token_inputs else ()
    strategy = module_strategy(module, state)
    state.__dict__["last_strategy"] = strategy  # a report field
    if not strategy.gathers_params:
        # A single device, DDP: no context to enter, here or around the backward.
        return _map_run(module, state, strategy, x, token_inputs, flat_inputs, check_hidden, None)
    with strategy.gathered(module):
        return _map_run(module, state, strategy, x, token_inputs, flat_inputs, check_hidden,
                        functools.partial(strategy.gathered, module))


def _map_run(module: nn.Module, state: TilingState, strategy: Strategy, x: torch.Tensor,
             token_inputs: Sequence[torch.Tensor], flat_inputs: Sequence[torch.Tensor], check_hidden: bool,
             gathered: Optional[Callable[[], ContextManager]]) -> torch.Tensor:
    plan = state.call_plan
    if plan is None or not plan.holds(call_config(module, state, strategy, x, flat_inputs), module):
        plan = current_plan(module, state, strategy, x, flat_inputs)
        if check_hidden:
            check_input(x, module)
    elif plan.strategy is not strategy:
        strategy.check_supported(module)
    decision = _decide(module, state, plan, strategy, x, flat_inputs)
    fields = state.__dict__
    kernel = decision.kernel
    if kernel is None:
        # Nothing to split, or too short for tiling to lower the peak: the plain module.
        fields["last_path"], fields["last_num_shards"], fields["last_reason"] = "untiled", 1, decision.reason
        return plan.shard_forward(x, *token_inputs)
    run = _run_for(decision, module, strategy, gathered, plan, state.grad_accum_dtype)
    if plan.named_buffers:
        # A buffer update (BatchNorm's running statistics) would run once per shard and again in the recompute.
        with buffers_kept(type(module).__name__, plan.named_buffers):
            out = sharded_apply(x, run)
    else:
        out = sharded_apply(x, run)
    fields["last_path"], fields["last_num_shards"], fields["last_reason"] = (
        decision.kernel_name, run.plan.num_shards, decision.reason)
    return out


def _local_view(strategy: Strategy, owner: nn.Module, kernel: Any, plan: Optional[MapPlan]) -> Any:
    if not getattr(kernel, "runs_on_local_view", False):
        return None
    # Per kernel class: under one plan, a kernel class computes on the same tensors.
    if plan is not None and plan.views.get(type(kernel), True) is None:
        return None
    view = strategy.local_view(owner, kernel.params)
    if plan is not None and view is None:
        plan.views[type(kernel)] = None
    if view is not None and view.why_not:
        raise RuntimeError(f"{kernel} chosen for {type(owner).__name__}, whose local view declines it: {view.why_not}")
    return view


def _run_for(decision: CallDecision, owner: nn.Module, strategy: Strategy,
             gathered: Optional[Callable[[], ContextManager]], plan: Optional[MapPlan],
             grad_accum_dtype: Optional[torch.dtype]) -> ShardedRun:
    """The run of ``decision``, reused where the strategy brings nothing made for this call."""
    kernel = decision.kernel
    assert kernel is not None and decision.num_shards is not None, "a decision with a kernel has a shard count"
    swaps = plan.swaps if plan is not None else strategy.swaps_param_storage(owner)
    key = (grad_accum_dtype, strategy.unused_grads_as_zeros, swaps)
    reusable = gathered is None and not strategy.delivers_grads
    if reusable:
        # Kept only where the plan's local view was None, which it stays for the plan (``_local_view``); a
        # decision made without a plan (the loss's) is made per call and keeps none.
        run = decision.runs.get(key)
        if run is not None:
            return run
    view = _local_view(strategy, owner, kernel, plan)
    deliver = strategy.deliver_grads if strategy.delivers_grads else None
    reusable = reusable and view is None
    trainable = {id(t) for t in decision.trainable}
    run = ShardedRun(
        kernel=kernel,
        plan=make_shard_plan(decision.num_tokens, decision.num_shards),
        gathered=gathered,
        grad_accum_dtype=grad_accum_dtype,
        # A kernel that provably draws no random numbers (the gated one) has none to replay.
        replay_rng=getattr(kernel, "replays_rng", True),
        param_mask=None if all(id(t) in trainable for t in kernel.params) else [id(t) in trainable for t in kernel.params],
        zeros_for_unused=strategy.unused_grads_as_zeros,
        deliver_grads=deliver,
        params_swap_storage=swaps,
        local_view=view,
        autocast=plan.autocast if plan is not None else None,
    )
    if reusable:
        decision.runs[key] = run
    return run


def _flat_token_inputs(x: torch.Tensor, token_inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    lead = x.shape[:-1]
    flat = []
    for token_input in token_inputs:
        if tuple(token_input.shape[:len(lead)]) != tuple(lead):
            raise ValueError(f"a sharded input of shape {tuple(token_input.shape)} does not share the leading (token) dims "
                             f"{tuple(lead)} of the hidden states {tuple(x.shape)}")
        flat.append(token_input.reshape(-1, *token_input.shape[len(lead):]))
    return flat


# -- the loss's call -------------------------------------------------------------------------------------------

def tiled_call(owner: nn.Module, strategy: Strategy, decide: Callable[[Strategy], CallDecision],
               run: Callable[[ShardedRun], torch.Tensor], grad_accum_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The tiled loss's call (its decision always names a kernel): ``decide`` and ``run`` inside the gathered
    region of ``owner``, the head whose backend gathers the parameters."""
    gathered = functools.partial(strategy.gathered, owner) if strategy.gathers_params else None
    with gathered() if gathered is not None else contextlib.nullcontext():
        return run(_run_for(decide(strategy), owner, strategy, gathered, None, grad_accum_dtype))


__all__: Tuple[str, ...] = ("CallDecision", "TiledInputs", "autograd_carries_the_call", "decide_map_call",
                            "module_forward", "module_strategy", "tiled_call")
