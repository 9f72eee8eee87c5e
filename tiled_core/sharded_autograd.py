"""The token-sharded autograd Function shared by every per-shard kernel.

Forward: flatten the leading dims into tokens, run the kernel one shard at a time into one output
allocated in the caller's shape (no graph is kept: the generic kernel runs the module in the caller's
grad mode and drops each shard's transient graph), keep only the input (saved before the loop by a node of
its own, see ``saved_input``) and each shard's RNG state.
Backward: recompute one shard at a time and sum the gradients over shards.

The parameters are *inputs* of the Function and their summed gradients are returned from
``backward``, so autograd accumulates each parameter's gradient exactly once per backward. That
single delivery is what DDP's reducer, FSDP2's reduce-scatter and ZeRO's gradient hooks expect
(any shard count, ``no_sync`` included); nothing backend-specific happens in here.

Any other tensor that needs a gradient and that the forward reads (a weight in a plain attribute or
a closure, a tensor a hook adds, conditioning set from outside) is an input too: for a kernel that may
read such tensors (the generic one) the first shard runs before the Function under a recorder of the
tensors it reads, and what it found is passed in with the parameters; a kernel that reads nothing but
its inputs (the fast one), or a call that builds no graph, runs every shard inside the Function. A later shard that reads one more such tensor is an error, never a lost gradient;
so is a tensor made inside a shard that outlives it (a hook that stashes an activation for a loss).

Backward trusts nothing autograd would check (``checks.py``): the version of every tensor the call
computed with (the input, the parameters, every other tensor the forward read, with or without a
gradient) is compared, and so is which tensors the recompute reads; a backward that builds a graph
(``create_graph=True``: a Hessian, a gradient penalty) is refused rather than answered with zeros.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass
from typing import Callable, ContextManager, Generic, List, Optional, Sequence, TypeVar

import torch
from torch.nn.utils import parametrize

from .autocast_state import AutocastState
from .checks import DOUBLE_BACKWARD_ERROR, INPUT_EDITED_ERROR, TensorVersions
from .collectives import completed, wait_released
from .grad_accum import GradAccumulator
from .grad_delivery import delivered_grads, needed_grads
from .kernels.base import ReduceKernel, ShardKernel, no_substitution
from .local_view import LocalView
from .rng import capture_rng_state
from .saved_input import InputHolder, save_input
from .shard_loops import backward_shards, forward_shards
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


KernelT = TypeVar("KernelT", ShardKernel, ReduceKernel)


@dataclass
class ShardedRun(Generic[KernelT]):
    """Everything one tiled call needs besides its tensors, for either autograd shape: the token-wise
    map (``sharded_apply``, a ``ShardKernel``) or the reduction (``sharded_reduce``, a ``ReduceKernel``)."""

    kernel: KernelT
    plan: ShardPlan
    # Re-gathers the parameters for the backward recompute (a backend's strategy decides how); None: the
    # strategy's ``gathered`` is the base class's no-op, and the backward enters no context for it.
    gathered: Optional[Callable[[], ContextManager]] = None
    grad_accum_dtype: Optional[torch.dtype] = None
    replay_rng: bool = True
    # Which of ``kernel.params`` receive gradients (the strategy's ``trainable_params``; the fast
    # kernel takes all the projections' tensors, trained or not). None: all of them.
    param_mask: Optional[Sequence[bool]] = None
    # Trainable inputs that received no gradient get zeros (a backend that waits for every reachable
    # parameter, DDP's reducer) instead of None (what the untiled module gives).
    zeros_for_unused: bool = False
    # The strategy's ``deliver_grads``: what autograd accumulates into each parameter, given the
    # gradients summed over the shards. Called once per backward, inside ``gathered``.
    deliver_grads: Optional[Callable[[Sequence[torch.Tensor], List[Optional[torch.Tensor]]], List[Optional[torch.Tensor]]]] = None
    # The backend legitimately replaces the parameters' storage between forward and backward (ZeRO-3
    # re-gathers into ``.data``, FSDP2 frees and re-allocates): their versions are not compared.
    params_swap_storage: bool = False
    # How the kernel sees the call's tensors where the parameters are distributed (``local_view.py``):
    # ``sharded_apply`` enters it around the Function, which then sees plain local tensors only.
    local_view: Optional[LocalView] = None


@dataclass(slots=True)
class FirstShard:
    """The first shard's output and RNG state, computed before the Function (see the module doc), or
    only what the Function needs to know about its input where the first shard runs inside it."""

    out: Optional[torch.Tensor]  # None: the Function runs the first shard too (nothing to watch)
    rng_state: Optional[tuple]
    watched: Optional[List[torch.Tensor]]  # the tensors later shards may read; None: not watched
    input_holder: Optional[InputHolder]  # where the input was saved; None: the Function saves it
    input_requires_grad: bool  # the caller's input (the Function's own input may be its saved view)
    # The input's version before the first shard (a forward must not edit it); None where no graph is
    # built (nothing will be recomputed; inference tensors have no version counter).
    input_version: Optional[int]


def _maybe(context: Optional[ContextManager]) -> ContextManager:
    return context if context is not None else contextlib.nullcontext()


def _watch(known: Optional[Sequence[torch.Tensor]], grad_only: bool = True) -> Optional[TensorReads]:
    return TensorReads(known=known, watch_kept=True, grad_only=grad_only) if known is not None else None


def _held_by_parametrization_cache(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a value ``torch.nn.utils.parametrize.cached()`` keeps (by identity): PEFT's LoRA on a
    parameter (``target_parameters``, fused MoE experts' weights) is such a parametrization."""
    return parametrize._cache_enabled > 0 and any(value is tensor for value in parametrize._cache.values())


def _check_nothing_kept(reads: TensorReads, expected: Sequence[torch.Tensor] = ()) -> None:
    if not _only_collectives_keep(reads, expected):
        # A reference cycle (a custom Function that stores its output on ctx, in a shard's transient
        # graph) keeps a tensor only until the collector runs: collect once (holding none of them) before refusing.
        gc.collect()
        kept = reads.kept(expected)
        if not all(map(reads.held_by_collective, kept)):
            cached = [t for t in kept if _held_by_parametrization_cache(t)]
            if cached:
                raise RuntimeError(PARAMETRIZATION_CACHE_ERROR.format(tensors=describe(cached)))
            raise RuntimeError(KEPT_TENSOR_ERROR.format(tensors=describe(kept)))
    # Only memory a collective took or made is left: its backend lets go of it a moment after the wait
    # (``collectives.py``), and every rank waits alike, so none is left alone in the next shard's collective.
    # Still alive after the bound, it is kept: by the tensor itself or by a view of it.
    held = reads.collective_memory(expected)
    if held and not wait_released([ref for ref, _ in held]):
        gc.collect()  # a reference cycle holding it, as above (collected only now: the backend's hold is common)
        still = [what for ref, what in held if not ref.expired()]
        if still:
            raise RuntimeError(KEPT_TENSOR_ERROR.format(tensors=", ".join(still)))


def _only_collectives_keep(reads: TensorReads, expected: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor made in the block that is still alive (none included) is one a collective took or
    made. The tensors are held by this frame alone, which is gone when it returns."""
    return all(map(reads.held_by_collective, reads.kept(expected)))


def _watched_forward(run: ShardedRun[ShardKernel], first: FirstShard, x_flat: torch.Tensor, out_flat: torch.Tensor,
                     slices: Sequence[slice], later: int, tensors: Sequence[torch.Tensor], rng_states: list) -> None:
    """The forward's shards from ``later`` on, each with its RNG state kept for the backward's replay and,
    where the first shard's reads were recorded, its own reads checked against them."""
    forward_shard = run.kernel.forward_shard
    for index, shard in enumerate(slices[later:], start=later):
        rng_states.append(capture_rng_state(x_flat.device) if run.replay_rng else None)
        if first.watched is None:
            forward_shard(x_flat[shard], out_flat[shard], tensors, shard)
            continue
        reads = TensorReads(known=first.watched, watch_kept=True, grad_only=True)
        with reads:
            forward_shard(x_flat[shard], out_flat[shard], tensors, shard)
        if reads.foreign:
            raise RuntimeError(LATE_TENSOR_ERROR.format(shard=index, tensors=describe(reads.foreign_tensors())))
        _check_nothing_kept(reads)


class ShardedMapFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, run: ShardedRun[ShardKernel], first: FirstShard, *tensors: torch.Tensor) -> torch.Tensor:
        # Shards are views of a detached input: a view made under no_grad still reports requires_grad.
        x_flat = x.detach().reshape(-1, x.shape[-1])
        slices = run.plan.slice_tuple
        kernel = run.kernel
        forward_shard = kernel.forward_shard
        autocast = AutocastState.capture(x.device)
        first_out, rng_states = first.out, [first.rng_state]
        output_width = getattr(kernel, "_output_width", None)  # the gated kernel's (kernels/base.py)
        if first_out is None and output_width is not None and not autocast.enabled:
            # The kernel names its output's width, and without autocast its dtype is the input's: every
            # shard writes into the one output, the first included.
            out = x.new_empty((*x.shape[:-1], output_width(tensors)))
            out_flat = out.view(-1, out.shape[-1])
            rng_states, later = [], 0
        else:
            if first_out is None:
                rng_states = [capture_rng_state(x.device) if run.replay_rng else None]
                first_out = forward_shard(x_flat[slices[0]], None, tensors, slices[0])
            out = first_out.new_empty((*x.shape[:-1], first_out.shape[-1]))
            out_flat = out.view(-1, out.shape[-1])
            out_flat[slices[0]].copy_(first_out)
            later = 1
        if first.watched is None and not run.replay_rng:
            # Nothing to watch or replay per shard: the plain loop every driver of a kernel runs.
            rng_states += [None] * (len(slices) - later)
            forward_shards(kernel, x_flat, out_flat, slices[later:], tensors)
        else:
            _watched_forward(run, first, x_flat, out_flat, slices, later, tensors, rng_states)
        if first.input_version is not None and x._version != first.input_version:
            raise RuntimeError(INPUT_EDITED_ERROR.format(module=run.kernel.module_name))
        if first.input_holder is None:
            ctx.save_for_backward(x)
        ctx.input_holder = first.input_holder
        ctx.input_requires_grad = first.input_requires_grad
        ctx.run = run
        ctx.rng_states = rng_states
        # Plain references, not saved tensors: backends swap parameter storage between forward and
        # backward (ZeRO-3 replaces .data, FSDP2 frees and re-allocates) without it being a mutation.
        # Their versions are compared in backward instead, where the backend allows it.
        ctx.tensors = tensors
        ctx.versions = _versions_to_check(run, tensors) if first.input_version is not None else None
        ctx.autocast = autocast
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # Autograd runs a backward with grad mode on exactly when it builds a graph (create_graph=True).
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD_ERROR)
        run: ShardedRun[ShardKernel] = ctx.run
        if ctx.versions is not None:
            ctx.versions.check(run.kernel.module_name)
        # Under non-reentrant checkpointing, reading the saved input recomputes the region up to it.
        (x,) = ctx.saved_tensors if ctx.input_holder is None else (ctx.input_holder.tensor(),)
        tensors = ctx.tensors
        needs_input_grad = ctx.needs_input_grad
        need_dx = needs_input_grad[0] and ctx.input_requires_grad
        num_params = len(run.kernel.params)
        grads = GradAccumulator(tensors, needed_grads(run, needs_input_grad[3:], num_params), run.grad_accum_dtype)

        x_flat = x.detach().reshape(-1, x.shape[-1])
        dy_flat = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        dx_flat = torch.empty_like(x_flat) if need_dx else None

        # One autocast context around the loop (the forward's state, whatever surrounds this backward);
        # an RNG context only where a shard drew random numbers to replay. A context that would do nothing
        # is not entered (each costs microseconds, the whole budget of a short call).
        contexts = _recompute_contexts(run, tensors, ctx.autocast)
        if not contexts:
            tensor_grads = _recompute(run, ctx.rng_states, x, x_flat, dy_flat, dx_flat, grads, tensors, num_params)
        else:
            with contextlib.ExitStack() as stack:
                for context in contexts:
                    stack.enter_context(context)
                tensor_grads = _recompute(run, ctx.rng_states, x, x_flat, dy_flat, dx_flat, grads, tensors, num_params)
        dx = None if dx_flat is None else dx_flat.view_as(x)
        return (dx, None, None, *tensor_grads)


def _recompute_contexts(run: ShardedRun[ShardKernel], tensors: Sequence[torch.Tensor],
                        autocast: AutocastState) -> List[ContextManager]:
    """The contexts the backward recompute runs in, outermost first, less those that would do nothing:
    the strategy's gathered region, the kernel's tensor substitution, the forward's autocast state."""
    contexts: List[ContextManager] = []
    if run.gathered is not None:
        contexts.append(run.gathered())
    using = run.kernel.using
    if using is not no_substitution:
        contexts.append(using(tensors))
    if autocast.needs_replay():
        contexts.append(autocast.replay())
    return contexts


def _recompute(run: ShardedRun[ShardKernel], rng_states: Sequence[Optional[tuple]], x: torch.Tensor,
               x_flat: torch.Tensor, dy_flat: torch.Tensor, dx_flat: Optional[torch.Tensor], grads: GradAccumulator,
               tensors: Sequence[torch.Tensor], num_params: int) -> List[Optional[torch.Tensor]]:
    """The backward's shard loop and the delivered gradients (inside the recompute's contexts: the
    gathered region is where the parameters are whole)."""
    backward_shards(run.kernel, run.plan.slice_tuple, x_flat, dy_flat, dx_flat, grads, tensors, rng_states)
    return delivered_grads(run, grads, tensors, num_params)


def _versions_to_check(run: ShardedRun[ShardKernel], tensors: Sequence[torch.Tensor]) -> TensorVersions:
    """The tensors the backward recomputes from, whose versions it checks: the Function's tensors and the
    module's frozen parameters (a LoRA base weight), less the parameters of a backend that re-gathers
    their storage between forward and backward."""
    if run.params_swap_storage:
        return TensorVersions(tensors[len(run.kernel.params):])
    if run.kernel.owned_params is run.kernel.params:  # the fast kernel: the Function's tensors start with them
        return TensorVersions(tensors)
    taken = {id(t) for t in tensors}
    return TensorVersions([*tensors, *(p for p in run.kernel.owned_params if id(p) not in taken)])


def sharded_apply(x: torch.Tensor, run: ShardedRun[ShardKernel]) -> torch.Tensor:
    """Run ``run`` over ``x``: the input saved first, then the first shard (before the Function where its
    reads are watched, else inside it), the rest inside the Function. With a local view, on the local
    input and parameters, the output handed to the view once."""
    view = run.local_view
    if view is None:
        return _sharded_apply(x, run, run.kernel.params)
    x_local = view.enter(x)
    local_tokens = x_local.numel() // x_local.shape[-1]
    if local_tokens != run.plan.num_tokens:
        # A view that enters this rank's own tokens (sequence parallelism: the call was handed a DTensor of
        # the whole sequence, of which this rank holds a slice) tiles those, over the planned shard count.
        run = dataclasses.replace(run, plan=make_shard_plan(local_tokens, run.plan.num_shards))
    local_params = view.params(run.kernel.params)
    using = run.kernel.using
    if using is no_substitution:
        return view.leave(_sharded_apply(x_local, run, local_params))
    # A kernel that runs the module's own forward reads its parameter slots: they hold the local tensors
    # for the forward shards as for the recompute (``_recompute_contexts``).
    with using(local_params):
        out = _sharded_apply(x_local, run, local_params)
    return view.leave(out)


def _sharded_apply(x: torch.Tensor, run: ShardedRun[ShardKernel], params: Sequence[torch.Tensor]) -> torch.Tensor:
    grad_enabled = torch.is_grad_enabled()
    input_version = x._version if grad_enabled and not x.is_inference() else None
    x_in, holder = save_input(x, params)
    # Tensors the forward reads besides x and the parameters matter only when a graph is being built.
    watch = run.kernel.may_read_other_tensors and grad_enabled
    if not watch:
        # Nothing to discover before the Function: it runs the first shard with the others (under the
        # no-grad mode autograd gives every Function's forward, as the first shard runs here).
        return ShardedMapFunction.apply(x_in, run, FirstShard(None, None, None, holder, x.requires_grad, input_version),
                                        *params)
    x_root = x.detach()
    x_flat = x_root.reshape(-1, x.shape[-1])
    first_slice = run.plan.slice_tuple[0]
    rng_state = capture_rng_state(x.device) if run.replay_rng else None
    # Every tensor the first shard reads from outside, with or without a gradient: the ones needing a
    # gradient become inputs of the Function, the others are held to what the backward recompute reads.
    reads = _watch([x_root, x_flat, *params, *run.kernel.owned_params] if watch else None, grad_only=False)
    with torch.no_grad(), _maybe(reads):
        first_out = completed(run.kernel.forward_shard(x_flat[first_slice], None, params, first_slice))
    others = []
    if reads is not None:
        _check_nothing_kept(reads, expected=[first_out])
        foreign = reads.foreign_tensors()
        others = [t for t in foreign if t.requires_grad]
        run.kernel.remember_reads([t for t in foreign if not t.requires_grad])
    watched = [*params, *run.kernel.owned_params, *others] if watch else None
    first = FirstShard(first_out, rng_state, watched, holder, x.requires_grad, input_version)
    return ShardedMapFunction.apply(x_in, run, first, *params, *others)
