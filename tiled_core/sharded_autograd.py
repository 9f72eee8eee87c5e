"""The one sharding mechanism every kernel runs through: token shards, recompute, one gradient delivery.

The map (``sharded_apply``) recomputes shard by shard in backward; the reduce (``sharded_reduce``, a loss) forms
its gradients in forward. The parameters are inputs of the Function, so autograd accumulates each gradient once
per backward, as DDP's reducer, FSDP2's reduce-scatter and ZeRO's hooks expect (docs/architecture.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Generic, Iterator, List, Optional, Sequence, TypeVar

import torch
from torch.nn.utils import parametrize

from .checks import DOUBLE_BACKWARD_ERROR, INPUT_EDITED_ERROR, raise_modified, version_of
from .collectives import completed, wait_released
from .kernels.base import ReduceKernel, ShardKernel
from .local_view import LocalView
from .shard_plan import ShardPlan, make_shard_plan
from .tensor_reads import TensorReads, describe

KEPT_TENSOR_ERROR = (
    "TiledMLP: tensors made inside the tiled forward were kept after their shard ({tensors}): a forward hook on a "
    "submodule, or the forward itself, stored them (an activation stashed for a loss, say). The tiled forward runs "
    "with no graph kept, once per shard, so they would carry no gradient and hold one shard's values. Register such "
    "a hook on the tiled module itself (it then sees the whole output, with autograd, once per call). A custom "
    "autograd Function that keeps its output on ctx (not through save_for_backward) does this too: its graph is a "
    "reference cycle the collector cannot free (it leaks untiled as well); save it with ctx.save_for_backward."
)
PARAMETRIZATION_CACHE_ERROR = (
    "TiledMLP: a forward inside the tiled call computed a parametrized weight ({tensors}) while "
    "torch.nn.utils.parametrize.cached() was on (an adapter put on a parameter as a parametrization may turn it on "
    "around the model's forward), and the cache keeps it until that context ends: every later "
    "shard and the backward's recompute would reuse the first shard's weight, whose graph the tiled call does not "
    "keep, so the parametrization's gradients would be lost. Leave this module untiled: untile(module), or exclude "
    "it when tiling the model."
)
LATE_TENSOR_ERROR = (
    "TiledMLP: shard {shard} of the forward read tensors that require grad which the first shard did not: "
    "{tensors}. The tiled call takes its gradient inputs from the first shard, so their gradients would be "
    "lost. Register them as parameters of the module, or read them in every call."
)
UNWRITTEN_GRAD_ERROR = (
    "kernel {kernel!r} for {module}: its backward returned no input gradient for a shard whose input requires "
    "grad. Return the shard's input gradient (zeros where the output does not depend on the input): the tiled "
    "call writes it into its rows, and would otherwise hand autograd memory nobody wrote."
)
SHARD_SHAPE_ERROR = (
    "kernel {kernel!r} for {module}: a shard's {what} returned rows of shape {got} for rows of shape {want} "
    "(the call's output is sized by the first shard or by the kernel's output_width; an input gradient is the input's)."
)
LOSS_DOUBLE_BACKWARD_ERROR = (
    "the tiled loss does not support double backward: a backward with create_graph=True reached it (a Hessian, "
    "a gradient penalty). Its gradients were formed in forward without a graph, so every second-order term "
    "through it would be zero. Compute this loss untiled for second-order gradients."
)
SECOND_BACKWARD_ERROR = (
    "tiled loss: backward was run a second time through the same call (retain_graph=True). Its gradients were "
    "formed in forward and handed over by the first backward; compute the loss again for another backward."
)


# -- RNG and autocast state, replayed around the recompute ------------------------------------------------------
def _device_module(device: torch.device):
    if device.type in ("cpu", "meta"):  # meta tensors (shape-only modelling) draw no numbers
        return None
    return torch.get_device_module(device.type)  # torch.cuda, torch.npu, ...: one code path for every device


def capture_rng_state(device: torch.device):
    module = _device_module(device)
    return torch.get_rng_state(), module.get_rng_state(device) if module is not None else None


@contextlib.contextmanager
def replay_rng_state(device: torch.device, state: tuple) -> Iterator[None]:
    module = _device_module(device)
    saved = capture_rng_state(device)
    torch.set_rng_state(state[0])
    if module is not None:
        module.set_rng_state(state[1], device)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        if module is not None:
            module.set_rng_state(saved[1], device)


def autocast_enabled(device_type: str) -> bool:
    # "meta" (shape-only modelling) has no autocast.
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


@dataclass(frozen=True)
class AutocastState:
    """The forward's autocast state, replayed around the recompute."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def capture(cls, device: torch.device) -> AutocastState:
        # The state with autocast off is kept per device (``device.type`` builds a new string at every read).
        off = _AUTOCAST_OFF.get(device)
        if off is None:
            off = _AUTOCAST_OFF[device] = cls(device.type, False, torch.float32)
        device_type = off.device_type
        if device_type == "meta" or not torch.is_autocast_enabled(device_type):  # "meta" has no autocast
            return off
        return cls(device_type, True, torch.get_autocast_dtype(device_type))

    def needs_replay(self) -> bool:
        # A recompute must not pick up an autocast around the caller's ``backward()`` either.
        return self.enabled or autocast_enabled(self.device_type)

    def replay(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


_AUTOCAST_OFF: Dict[torch.device, AutocastState] = {}


# -- the input, saved by a node of its own before the shard loop -------------------------------------------------
# Saved before the loop, a non-reentrant checkpoint's recompute stops before the MLP where the MLP is the region's
# last saver (Llama, Qwen, Mistral): 2 MLP forwards a step, not 3. Only where a saved-tensor hook is active.
class InputHolder:

    __slots__ = ("node",)

    def __init__(self) -> None:
        self.node: Optional[Any] = None

    def tensor(self) -> torch.Tensor:
        assert self.node is not None, "SaveInput ran before the sharded Function"
        (x,) = self.node.saved_tensors
        return x


class SaveInput(torch.autograd.Function):
    """``x`` -> a view of ``x``, saving ``x``; ``anchors`` (the parameters) record the node for a frozen input too."""

    @staticmethod
    def forward(ctx, holder: InputHolder, x: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        holder.node = ctx
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, grad if ctx.needs_input_grad[1] else None, *([None] * (len(ctx.needs_input_grad) - 2)))


# -- gradients: one buffer per tensor, summed over shards, delivered once ----------------------------------------
class GradAccumulator:
    """One gradient buffer per tensor. The buffer is the gradient ``backward`` returns: the first shard's
    contribution is written into fresh memory and later ones added in place; autograd then adds it to
    ``.grad`` once per backward (micro-batch accumulation kept, every backend's hook fired once)."""

    def __init__(self, params: Sequence[torch.Tensor], needed: Sequence[bool], accum_dtype: Optional[torch.dtype] = None):
        self._params = list(params)
        self.needed = list(needed)
        self._accum_dtype = accum_dtype  # None: each tensor's own dtype (no extra buffer, no cast)
        self._buffers: List[Optional[torch.Tensor]] = [None] * len(self._params)

    def dtype_for(self, index: int) -> torch.dtype:
        own = self._params[index].dtype
        return own if self._accum_dtype is None else torch.promote_types(self._accum_dtype, own)

    def add(self, index: int, grad: Optional[torch.Tensor]) -> None:
        if grad is None or not self.needed[index]:
            return
        buffer = self._buffers[index]
        if buffer is None:  # the shard's gradient becomes the buffer: no copy
            self._buffers[index] = grad if grad.dtype == self.dtype_for(index) else grad.to(self.dtype_for(index))
        else:
            buffer.add_(grad)

    def add_matmul(self, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if not self.needed[index]:
            return
        buffer = self._buffers[index]
        if self.dtype_for(index) != a.dtype:
            self.add(index, torch.mm(a, b))
        elif buffer is None:
            self._buffers[index] = torch.mm(a, b)
        else:
            buffer.addmm_(a, b)

    def add_rowsum(self, index: int, rows: torch.Tensor) -> None:
        if not self.needed[index]:
            return
        buffer = self._buffers[index]
        if buffer is None or self.dtype_for(index) != rows.dtype:
            self.add(index, rows.sum(0, dtype=self.dtype_for(index)))
        else:
            buffer.add_(rows.sum(0))

    def results(self, zeros_for_unused: bool = False) -> List[Optional[torch.Tensor]]:
        """Each tensor's summed gradient in its dtype; for an unused one, None (as untiled) or zeros."""
        out: List[Optional[torch.Tensor]] = []
        for param, buffer, needed in zip(self._params, self._buffers, self.needed, strict=True):
            if not needed:
                out.append(None)
            elif buffer is None:
                out.append(torch.zeros_like(param) if zeros_for_unused else None)
            else:
                out.append(buffer if buffer.dtype == param.dtype else buffer.to(param.dtype))
        return out


def needed_grads(run: ShardedRun[Any], needs_input_grad: Sequence[bool], num_params: int) -> List[bool]:
    """Which of the Function's tensors get a gradient: those autograd asks for, less the parameters the
    strategy leaves out (``param_mask``); tensors after the parameters always get theirs."""
    mask = run.param_mask
    if mask is None:
        return list(needs_input_grad)
    return [need and (i >= num_params or mask[i]) for i, need in enumerate(needs_input_grad)]


def delivered_grads(run: ShardedRun[Any], grads: GradAccumulator, tensors: Sequence[torch.Tensor],
                    num_params: int) -> List[Optional[torch.Tensor]]:
    result = grads.results(run.zeros_for_unused)
    if run.deliver_grads is not None:
        result[:num_params] = run.deliver_grads(tensors[:num_params], result[:num_params])
    return result


# -- the shard loops (the Functions below, and the custom ops of ``ops/``) ---------------------------------------
def _write(kernel: ShardKernel, what: str, rows: torch.Tensor, got: torch.Tensor) -> None:
    # Never broadcast in silence.
    if got.shape != rows.shape:
        raise RuntimeError(SHARD_SHAPE_ERROR.format(kernel=kernel.name, module=kernel.module_name, what=what,
                                                    got=tuple(got.shape), want=tuple(rows.shape)))
    rows.copy_(got)


def forward_shards(kernel: ShardKernel, x_flat: torch.Tensor, out_flat: torch.Tensor, slices: Sequence[slice],
                   tensors: Sequence[torch.Tensor]) -> None:
    """Each shard of ``x_flat`` through the kernel, into its rows of ``out_flat`` (copied where it returned other
    memory)."""
    forward_into = kernel.forward_into
    for shard in slices:
        rows = out_flat[shard]
        y = forward_into(x_flat[shard], rows, tensors, shard)
        if y is not rows:
            _write(kernel, "forward", rows, y)


def backward_shards(kernel: ShardKernel, slices: Sequence[slice], x_flat: torch.Tensor, dy_flat: torch.Tensor,
                    dx_flat: Optional[torch.Tensor], grads: GradAccumulator, tensors: Sequence[torch.Tensor],
                    rng_states: Optional[Sequence[Optional[tuple]]] = None) -> None:
    """Each shard recomputed: its input gradient into its rows of ``dx_flat`` (None: not needed), its tensors'
    gradients added to ``grads``."""
    backward_into = kernel.backward_into
    states = rng_states if rng_states is not None else (None,) * len(slices)
    for shard, rng_state in zip(slices, states, strict=True):
        rows = None if dx_flat is None else dx_flat[shard]
        if rng_state is None:
            dx = backward_into(x_flat[shard], dy_flat[shard], rows, grads, tensors, shard)
        else:
            with replay_rng_state(x_flat.device, rng_state):
                dx = backward_into(x_flat[shard], dy_flat[shard], rows, grads, tensors, shard)
        if dx is not rows:
            if dx is None:  # rows is not None here
                raise RuntimeError(UNWRITTEN_GRAD_ERROR.format(kernel=kernel.name, module=kernel.module_name))
            if rows is not None:
                _write(kernel, "backward", rows, dx)


def reduce_shards(kernel: ReduceKernel, x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                  dx_flat: Optional[torch.Tensor], grads: Optional[GradAccumulator], params: Sequence[torch.Tensor],
                  slices: Sequence[slice]) -> torch.Tensor:
    x_flat = x.detach().reshape(-1, x.shape[-1])
    target_flat = targets.reshape(-1)
    compute = kernel.compute_tensors(x, params)
    total: Optional[torch.Tensor] = None
    for shard in slices:
        loss = kernel.shard(x_flat[shard], target_flat[shard], scale, None if dx_flat is None else dx_flat[shard],
                            grads, compute)
        total = loss if total is None else total.add_(loss)
    assert total is not None  # a plan has at least one shard
    return total


# -- the run: everything a call needs besides its tensors --------------------------------------------------------
KernelT = TypeVar("KernelT", ShardKernel, ReduceKernel)


@dataclass
class ShardedRun(Generic[KernelT]):
    kernel: KernelT
    plan: ShardPlan
    # Re-gathers the parameters for the backward recompute; None: nothing to enter.
    gathered: Optional[Callable[[], ContextManager]] = None
    grad_accum_dtype: Optional[torch.dtype] = None
    replay_rng: bool = True
    # Which of ``kernel.params`` receive gradients (the strategy's trainable ones); None: all of them.
    param_mask: Optional[Sequence[bool]] = None
    # Trainable inputs that received no gradient get zeros (DDP's reducer waits for every one), else None.
    zeros_for_unused: bool = False
    # The strategy's ``deliver_grads``, called once per backward inside ``gathered``.
    deliver_grads: Optional[Callable[[Sequence[torch.Tensor], List[Optional[torch.Tensor]]], List[Optional[torch.Tensor]]]] = None
    # The backend swaps the parameters' storage between forward and backward (ZeRO-3, FSDP2): no version check.
    params_swap_storage: bool = False
    # How the kernel sees distributed parameters (``local_view.py``), entered around the Function.
    local_view: Optional[LocalView] = None
    # The forward's autocast state where the call's plan fixed it (its device and autocast are part of the
    # plan's key); None: read at each call.
    autocast: Optional[AutocastState] = None


# -- the map shape ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class FirstShard:
    """The first shard's output and RNG state where it ran before the Function (its reads watched)."""

    out: Optional[torch.Tensor]  # None: the Function runs the first shard too
    rng_state: Optional[tuple]
    watched: Optional[List[torch.Tensor]]  # the tensors later shards may read; None: not watched
    input_holder: Optional[InputHolder]  # None: the Function saves its input itself
    input_requires_grad: bool  # the caller's input's (the Function's may be its saved view)
    input_version: Optional[int]  # None where no graph is built (nothing is recomputed)


def _held_by_parametrization_cache(tensor: torch.Tensor) -> bool:
    # PEFT's LoRA on a parameter is a parametrization.
    return parametrize._cache_enabled > 0 and any(value is tensor for value in parametrize._cache.values())


def _check_nothing_kept(reads: TensorReads, expected: Sequence[torch.Tensor] = ()) -> None:
    if not all(map(reads.held_by_collective, reads.kept(expected))):
        # A reference cycle (a custom Function storing its output on ctx) lasts until the collector runs.
        gc.collect()
        kept = reads.kept(expected)
        if not all(map(reads.held_by_collective, kept)):
            cached = [t for t in kept if _held_by_parametrization_cache(t)]
            if cached:
                raise RuntimeError(PARAMETRIZATION_CACHE_ERROR.format(tensors=describe(cached)))
            raise RuntimeError(KEPT_TENSOR_ERROR.format(tensors=describe(kept)))
    # Only memory a collective took or made is left: its backend lets go of it a moment after the wait.
    held = reads.collective_memory(expected)
    if held and not wait_released([ref for ref, _ in held]):
        gc.collect()
        still = [what for ref, what in held if not ref.expired()]
        if still:
            raise RuntimeError(KEPT_TENSOR_ERROR.format(tensors=", ".join(still)))


def _watched_forward(run: ShardedRun[ShardKernel], first: FirstShard, x_flat: torch.Tensor, out_flat: torch.Tensor,
                     slices: Sequence[slice], later: int, tensors: Sequence[torch.Tensor], rng_states: list) -> None:
    kernel = run.kernel
    for index, shard in enumerate(slices[later:], start=later):
        rng_states.append(capture_rng_state(x_flat.device) if run.replay_rng else None)
        if first.watched is None:
            forward_shards(kernel, x_flat, out_flat, (shard,), tensors)
            continue
        reads = TensorReads(known=first.watched, watch_kept=True, grad_only=True)
        with reads:
            forward_shards(kernel, x_flat, out_flat, (shard,), tensors)
        if reads.foreign:
            raise RuntimeError(LATE_TENSOR_ERROR.format(shard=index, tensors=describe(reads.foreign_tensors())))
        _check_nothing_kept(reads)


def _recompute_contexts(run: ShardedRun[ShardKernel], kernel: ShardKernel, tensors: Sequence[torch.Tensor],
                        autocast: AutocastState) -> Optional[ContextManager]:
    """The recompute's contexts entered, outermost first; those that would do nothing are left out (None: all)."""
    if run.gathered is None and not kernel.substitutes_tensors and not autocast.needs_replay():
        return None
    stack = contextlib.ExitStack()
    try:
        if run.gathered is not None:
            stack.enter_context(run.gathered())
        if kernel.substitutes_tensors:
            stack.enter_context(kernel.using(tensors))
        if autocast.needs_replay():
            stack.enter_context(autocast.replay())
    except BaseException:
        stack.close()  # the contexts already entered are left, as a with statement would
        raise
    return stack


class ShardedMapFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, run: ShardedRun[ShardKernel], first: FirstShard, *tensors: torch.Tensor) -> torch.Tensor:
        # Shards are views of a detached input: a view made under no_grad still reports requires_grad.
        shape = x.shape
        x_flat = x.detach().reshape(-1, shape[-1])
        slices = run.plan.slice_tuple
        kernel = run.kernel
        autocast = run.autocast if run.autocast is not None else AutocastState.capture(x.device)
        first_out, rng_states = first.out, [first.rng_state]
        width = kernel.output_width(tensors) if first_out is None and not autocast.enabled else None
        if width is not None:
            # Width known and dtype the input's (no autocast): every shard writes into the one output; one as wide as
            # a contiguous input (an MLP's) is allocated like it, the cheapest allocation.
            same = width == shape[-1] and x.is_contiguous()
            out = torch.empty_like(x) if same else x.new_empty((*shape[:-1], width))
            out_flat = out.view(-1, width)
            rng_states, later = [], 0
        else:
            if first_out is None:
                rng_states = [capture_rng_state(x.device) if run.replay_rng else None]
                first_out = kernel.forward_into(x_flat[slices[0]], None, tensors, slices[0])
            out = first_out.new_empty((*shape[:-1], first_out.shape[-1]))
            out_flat = out.view(-1, out.shape[-1])
            out_flat[slices[0]].copy_(first_out)
            later = 1
        if first.watched is None and not run.replay_rng:
            rng_states += [None] * (len(slices) - later)
            forward_shards(kernel, x_flat, out_flat, slices[later:], tensors)
        else:
            _watched_forward(run, first, x_flat, out_flat, slices, later, tensors, rng_states)
        if first.input_version is not None and x._version != first.input_version:
            raise RuntimeError(INPUT_EDITED_ERROR.format(module=kernel.module_name))
        if first.input_holder is None:
            ctx.save_for_backward(x)
        ctx.input_holder = first.input_holder
        ctx.input_requires_grad = first.input_requires_grad
        ctx.run = run
        ctx.rng_states = rng_states
        # Plain references, not saved tensors: backends swap parameter storage between forward and backward.
        ctx.tensors = tensors
        if first.input_version is None:
            ctx.checked = None
        else:
            # The Function's tensors start with every parameter (the common case), unless the backend re-gathers them.
            plain = not run.params_swap_storage and kernel.owned_params is kernel.params
            checked = tensors if plain else _versions_to_check(run, tensors)
            ctx.checked, ctx.versions = checked, list(map(version_of, checked))
        ctx.autocast = autocast
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # Autograd runs a backward with grad mode on exactly when it builds a graph (create_graph=True).
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD_ERROR)
        run: ShardedRun[ShardKernel] = ctx.run
        kernel = run.kernel
        if ctx.checked is not None and list(map(version_of, ctx.checked)) != ctx.versions:
            raise_modified(ctx.checked, ctx.versions, kernel.module_name)
        # Under non-reentrant checkpointing, reading the saved input recomputes the region up to it.
        (x,) = ctx.saved_tensors if ctx.input_holder is None else (ctx.input_holder.tensor(),)
        x_flat = x.detach().reshape(-1, x.shape[-1])
        tensors = ctx.tensors
        needs_input_grad = ctx.needs_input_grad
        need_dx = needs_input_grad[0] and ctx.input_requires_grad
        num_params = len(kernel.params)
        grads = GradAccumulator(tensors, needed_grads(run, needs_input_grad[3:], num_params), run.grad_accum_dtype)
        dy_flat = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        dx_flat = torch.empty_like(x_flat) if need_dx else None
        contexts = _recompute_contexts(run, kernel, tensors, ctx.autocast)
        if contexts is None:  # nothing to enter: no with statement's two calls
            backward_shards(kernel, run.plan.slice_tuple, x_flat, dy_flat, dx_flat, grads, tensors, ctx.rng_states)
            tensor_grads = delivered_grads(run, grads, tensors, num_params)
        else:
            with contexts:
                backward_shards(kernel, run.plan.slice_tuple, x_flat, dy_flat, dx_flat, grads, tensors, ctx.rng_states)
                # Delivered inside the gathered region, where the parameters are whole.
                tensor_grads = delivered_grads(run, grads, tensors, num_params)
        return (None if dx_flat is None else dx_flat.view_as(x), None, None, *tensor_grads)


def _versions_to_check(run: ShardedRun[ShardKernel], tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """The tensors the backward recomputes from, less parameters whose storage the backend re-gathers."""
    kernel = run.kernel
    if run.params_swap_storage:
        return tensors[len(kernel.params):]
    taken = {id(t) for t in tensors}
    return (*tensors, *(p for p in kernel.owned_params if id(p) not in taken))


def sharded_apply(x: torch.Tensor, run: ShardedRun[ShardKernel]) -> torch.Tensor:
    """Run ``run`` over ``x``; with a local view, on the local input and parameters."""
    view = run.local_view
    if view is None:
        return _sharded_apply(x, run, run.kernel.params)
    x_local = view.enter(x)
    local_tokens = x_local.numel() // x_local.shape[-1]
    if local_tokens != run.plan.num_tokens:
        # A view that enters this rank's own tokens (sequence parallelism) tiles those, over the planned count.
        run = dataclasses.replace(run, plan=make_shard_plan(local_tokens, run.plan.num_shards))
    local_params = view.params(run.kernel.params)
    if not run.kernel.substitutes_tensors:
        return view.leave(_sharded_apply(x_local, run, local_params))
    # A kernel that runs the module's own forward reads its parameter slots: they hold the local tensors.
    with run.kernel.using(local_params):
        out = _sharded_apply(x_local, run, local_params)
    return view.leave(out)


def _sharded_apply(x: torch.Tensor, run: ShardedRun[ShardKernel], params: Sequence[torch.Tensor]) -> torch.Tensor:
    grad_enabled = torch.is_grad_enabled()
    input_version = x._version if grad_enabled and not x.is_inference() else None
    # The input saved by ``SaveInput`` where a saved-tensor hook is active, else by the Function itself.
    x_in, holder = x, None
    if grad_enabled and (x.requires_grad or any(t.requires_grad for t in params)):
        try:
            hooks_active = torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
        except (AttributeError, TypeError, RuntimeError):
            hooks_active = True  # this torch cannot tell
        if hooks_active:
            holder = InputHolder()
            x_in = SaveInput.apply(holder, x, *params)
    kernel = run.kernel
    if not (kernel.may_read_other_tensors and grad_enabled):
        # Nothing to discover before the Function: it runs the first shard with the others.
        return ShardedMapFunction.apply(x_in, run, FirstShard(None, None, None, holder, x.requires_grad, input_version),
                                        *params)
    x_root = x.detach()
    x_flat = x_root.reshape(-1, x.shape[-1])
    first_slice = run.plan.slice_tuple[0]
    rng_state = capture_rng_state(x.device) if run.replay_rng else None
    # Tensors the first shard reads from outside: those needing a gradient become inputs of the Function.
    reads = TensorReads(known=[x_root, x_flat, *params, *kernel.owned_params], watch_kept=True, grad_only=False)
    with torch.no_grad(), reads:
        first_out = completed(kernel.forward_into(x_flat[first_slice], None, params, first_slice))
    _check_nothing_kept(reads, expected=[first_out])
    foreign = reads.foreign_tensors()
    others = [t for t in foreign if t.requires_grad]
    kernel.remember_reads([t for t in foreign if not t.requires_grad])
    first = FirstShard(first_out, rng_state, [*params, *kernel.owned_params, *others], holder, x.requires_grad,
                       input_version)
    return ShardedMapFunction.apply(x_in, run, first, *params, *others)


# -- the reduce shape (a loss) ------------------------------------------------------------------------------------
# Forward forms each shard's gradients at once (no [tokens, vocab] tensor outlives its shard); backward scales them
# by the gradient that arrives (the output is a scalar) and delivers them as the map shape does.
class ShardedReduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, run: ShardedRun[ReduceKernel],
                building_graph: bool, *params: torch.Tensor) -> torch.Tensor:
        # ``needs_input_grad`` is set under no_grad too: ``building_graph`` is the caller's grad mode.
        num_params = len(params)
        needs = [building_graph and need for need in ctx.needs_input_grad]
        needed = needed_grads(run, needs[5:], num_params)
        grads = GradAccumulator(params, needed, run.grad_accum_dtype) if any(needed) else None
        dx_flat = x.new_empty((x.numel() // x.shape[-1], x.shape[-1])) if needs[0] else None
        total = reduce_shards(run.kernel, x, targets, scale, dx_flat, grads, params, run.plan.slice_tuple)
        ctx.dx = None if dx_flat is None else dx_flat.view_as(x)
        ctx.param_grads = delivered_grads(run, grads, params, num_params) if grads is not None else [None] * num_params
        return total

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError(LOSS_DOUBLE_BACKWARD_ERROR)
        if ctx.param_grads is None:
            raise RuntimeError(SECOND_BACKWARD_ERROR)
        dx, param_grads = ctx.dx, ctx.param_grads
        ctx.dx = ctx.param_grads = None  # handed over: nothing else keeps them alive after this backward
        # In place: the forward made each buffer and nothing else references it.
        scaled = [None if g is None else g.mul_(grad_loss) for g in (dx, *param_grads)]
        return (scaled[0], None, None, None, None, *scaled[1:])


def sharded_reduce(x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, run: ShardedRun[ReduceKernel],
                   params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum over shards of ``run.kernel``'s shard losses (each times ``scale``). Call it inside the
    strategy's gathered region: autograd records the parameters' shapes here, whole."""
    return ShardedReduceFunction.apply(x, targets, scale, run, torch.is_grad_enabled(), *params)
