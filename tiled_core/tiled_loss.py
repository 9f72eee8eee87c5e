"""The tiled causal-LM loss: output head + cross-entropy over token shards (``tiled_call`` in the reduction
shape), never holding the logits. It runs as the forward of one call of the head (``in_head_call``), so that a
backend's module hooks on the head (ZeRO-3's gather and release) surround it as they surround
``lm_head(hidden)``; other hooks of the head would see the loss as its output and are refused. Under
``torch.compile`` a plain linear head whose backend owns nothing around the call is one op
(``ops/linear_cross_entropy.py``); any other call runs eagerly behind one graph break.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_globals
from torch.nn.modules._functions import BackwardHookFunction  # what full backward hooks wrap outputs in

from tiled_mlp.strategies.base import Strategy, VocabSlice
from tiled_mlp.strategies.resolver import StrategyArg, resolve_strategy, strategy_from_arg, sums_over_sequence_ranks

from . import dynamo_support
from .gated_spec import GLOBAL_HOOK_DICTS, MODULE_HOOK_DICTS, hook_count
from .kernel_registry import REDUCE, KernelCall, choose_kernel
from .kernels.cross_entropy import CrossEntropyOptions, check_targets
from .kernels.lm_head import is_plain_linear, loss_dtype
from .loss_shards import loss_num_shards
from .ops.linear_cross_entropy import linear_cross_entropy
from .sequence_group import check_group, group_count, sum_over_group
from .shard_plan import AUTO, NumShards, check_num_shards
from .sharded_autograd import ShardedRun, autocast_enabled, sharded_reduce
from .tiled_call import CallDecision, autograd_carries_the_call, tiled_call
from .tiling_state import check_grad_accum_dtype

REDUCTIONS = ("mean", "sum")
# A head whose vocabulary cannot be read before it runs: "auto" sizes its shards for a vocabulary this large
# (Llama 3's is 128256), so that a shard's logits stay within the budget for any common head.
UNKNOWN_VOCAB = 2**17
SHARDED_WEIGHT_ERROR = (
    "tiled loss: {head}'s parameters are DTensors here ({layout}) and its strategy {strategy!r} computes with "
    "whole tensors. FSDP2's sharded DTensors (outside the forward of the unit that owns them): compute the loss inside "
    "that unit's forward (inside lm_head's own call, say), or keep lm_head in a unit whose forward surrounds the "
    "loss. Under tensor parallelism: parallelize lm_head with ColwiseParallel (its weight Shard(0) over a 1-D "
    "mesh) and leave strategy='auto', which computes the loss split over the vocabulary."
)
HEAD_HOOKS_ERROR = (
    "tiled loss: {head} carries hooks of its own ({hooks}); the loss runs inside the head's call (so that a "
    "backend's hooks on it surround the loss), where these would see the hidden states and the loss instead of "
    "the logits, and could change the loss. Remove them from the head, or leave the tiled loss off"
)
GLOBAL_HOOK_ERROR = (
    "tiled loss: a forward hook registered for every module (torch.nn.modules.module.register_module_forward_hook: "
    "{hooks}) changed what {head}'s call returned; the loss runs inside the head's call, so the hook was given the "
    "loss where it would be given the logits, and the loss it returned is not the model's. Remove the hook while "
    "the tiled loss runs (its handle's remove()), or leave the tiled loss off"
)


def tiled_cross_entropy(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    labels: Optional[torch.Tensor] = None,
    *,
    shift_labels: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
    label_smoothing: float = 0.0,
    logit_softcap: Optional[float] = None,
    z_loss: float = 0.0,
    num_shards: NumShards = AUTO,
    strategy: StrategyArg = "auto",
    grad_accum_dtype: Optional[torch.dtype] = None,
    sequence_group: Optional[Any] = None,
    model: Optional[nn.Module] = None,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` on ``lm_head(hidden)`` (``[..., tokens, hidden]``, after the last norm),
    a token shard at a time; a 0-dim float32 tensor (float64 for a float64 head). ``shift_labels`` win over
    ``labels``; ``num_items_in_batch`` overrides ``reduction``. Under sequence parallelism (``sequence_group``,
    and ``model``, whose backend is asked about the group) every rank returns the whole sequence's loss. Each
    argument: docs/long-context-stack.md, "Tiled loss".
    """
    options = _options(ignore_index, label_smoothing, logit_softcap, z_loss, reduction, num_shards)
    check_grad_accum_dtype(grad_accum_dtype)
    if labels is None and shift_labels is None:
        raise ValueError("tiled loss: pass labels (shifted here: position t predicts t+1) or shift_labels (already shifted)")
    given = shift_labels if shift_labels is not None else labels
    if not isinstance(given, torch.Tensor) or given.is_floating_point() or given.is_complex() or given.dtype == torch.bool:
        raise TypeError(f"tiled loss: labels must be an integer tensor, got {getattr(given, 'dtype', type(given).__name__)}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or not hidden.is_floating_point():
        raise ValueError("tiled loss: hidden must be a floating-point tensor of shape [..., tokens, hidden], got "
                         f"{getattr(hidden, 'shape', type(hidden).__name__)}")
    if not isinstance(lm_head, nn.Module):
        raise TypeError(f"tiled loss: lm_head must be an nn.Module (the output head), got {type(lm_head).__name__}")
    in_features = _declared_width(lm_head, "in_features", 1)
    if in_features is not None and hidden.shape[-1] != in_features:
        raise ValueError(f"tiled loss: hidden size {hidden.shape[-1]} does not match {type(lm_head).__name__}'s "
                         f"in_features {in_features}")
    if sequence_group is not None:
        check_group(sequence_group)
        if shift_labels is None:  # a slice's labels shifted within the slice would lose each slice's last target
            raise ValueError("tiled loss: under sequence parallelism give shift_labels, shifted over the whole sequence "
                             "before it was split (the sequence-parallel sharding step makes them); labels would be "
                             "shifted within this rank's slice")
    args = (hidden, lm_head, labels, shift_labels, options, reduction, num_items_in_batch, num_shards, strategy,
            grad_accum_dtype, sequence_group, model)
    if not torch.compiler.is_compiling():
        return _loss(*args)
    if dynamo_support.TRACES_TILED_CALLS and _traced_as_op(lm_head, strategy, sequence_group is not None,
                                                           hook_count(lm_head), global_hook_count()):
        return _traced_linear_loss(*args[:8], grad_accum_dtype)
    return _eager_loss(*args)


def _loss(hidden, lm_head, labels, shift_labels, options: CrossEntropyOptions, reduction: str, num_items_in_batch,
          num_shards: NumShards, strategy: StrategyArg, grad_accum_dtype: Optional[torch.dtype],
          sequence_group: Optional[Any], model: Optional[nn.Module]) -> torch.Tensor:
    fixed = strategy_from_arg(strategy)
    # Before any work: a backend that cannot carry a loss split across the group refuses here.
    averages = sequence_group is None or not sums_over_sequence_ranks(model if model is not None else lm_head,
                                                                      sequence_group, fixed)
    backend, splits_vocab, dtensors = _backend(lm_head, fixed)
    head_call = backend.head_call(lm_head)
    if dtensors and splits_vocab is None and not head_call.gathers:
        mesh = getattr(dtensors[0], "device_mesh", None)
        layout = (f"placements {tuple(getattr(dtensors[0], 'placements', ()))} over a mesh of shape "
                  f"{tuple(getattr(mesh, 'shape', ()))}")
        raise RuntimeError(SHARDED_WEIGHT_ERROR.format(head=type(lm_head).__name__, layout=layout, strategy=backend.name))
    foreign = [getattr(hook, "__qualname__", type(hook).__qualname__) for name in MODULE_HOOK_DICTS
               for hook in getattr(lm_head, name, {}).values() if not head_call.owns_hook(hook)]
    if foreign:
        raise RuntimeError(HEAD_HOOKS_ERROR.format(head=type(lm_head).__name__, hooks=", ".join(foreign)))
    # A vocabulary split over ranks: this rank's rows and the hidden states as the head's own input hook makes
    # them (a sequence-parallel input is gathered there), so the labels are the tokens the head sees.
    vocab_slice: Optional[VocabSlice] = splits_vocab(lm_head, hidden) if splits_vocab is not None else None
    head_input = vocab_slice.hidden if vocab_slice is not None else hidden
    targets = _shifted_targets(head_input, labels, shift_labels, options.ignore_index)
    scale_of = functools.partial(_scale, targets, reduction, num_items_in_batch, options.ignore_index, group=sequence_group)
    site = LossSite(lm_head, backend, targets, options, scale_of, num_shards, grad_accum_dtype, vocab_slice)
    if vocab_slice is not None:  # the head's hooks are the style's own, which the slice stands in for
        return site.loss_of(head_input)
    loss = in_head_call(lm_head, hidden, site.loss_of, head_call.sees_graph)
    return sum_over_group(loss, sequence_group, averages)


_eager_loss = dynamo_support.disable(_loss)


class _ForwardForOneCall:
    """The head's forward for one call: puts back what was there, then runs ``work``. An object, not a closure
    over itself: a reference cycle would keep the hidden states and the loss's site alive until a collection."""

    def __init__(self, head: nn.Module, work: Callable[[torch.Tensor], torch.Tensor], hidden: Optional[torch.Tensor]):
        self.head = head
        self.work = work
        self.hidden = hidden  # where the head is given a stand-in: the hidden states the loss computes with
        self.previous = vars(head).get("forward")
        self.result: Any = None  # what ``work`` returned, and its version counter then (a tensor's)
        self.version: Optional[int] = None

    def put_back(self) -> None:
        if vars(self.head).get("forward") is not self:
            return
        if self.previous is not None:
            self.head.__dict__["forward"] = self.previous
        else:
            del self.head.__dict__["forward"]

    def __call__(self, given: torch.Tensor) -> torch.Tensor:
        self.put_back()
        if self.hidden is not None:  # as the hooks handed over the stand-in: cast, or moved by a root's hook
            given = self.hidden.to(device=given.device, dtype=given.dtype)
        self.result = self.work(given)
        self.version = _version(self.result)
        return self.result


def in_head_call(head: nn.Module, hidden: torch.Tensor, work: Callable[[torch.Tensor], torch.Tensor],
                 sees_graph: bool = True) -> Any:
    """``work(hidden)``, run as the forward of one call ``head(hidden)``. With ``sees_graph`` False (an FSDP2
    unit of several modules, whose hooks must not see the graph) the hooks get ``hidden.detach()``."""
    forward = _ForwardForOneCall(head, work, None if sees_graph else hidden)
    head.__dict__["forward"] = forward
    try:
        out = head(hidden if sees_graph else hidden.detach())
    finally:
        forward.put_back()  # where a pre-hook raised before the forward ran
    # The head's own hooks were checked before (only a backend's may be there, and may hand on another tensor);
    # where there are none, only a global hook can have replaced the loss or changed it in place.
    loss = forward.result
    if loss is not None and hook_count(head) == 0 and not _is_the_loss(out, loss, forward.version):
        hooks = [getattr(h, "__qualname__", type(h).__qualname__)
                 for h in _module_globals._global_forward_hooks.values()]
        raise RuntimeError(GLOBAL_HOOK_ERROR.format(hooks=", ".join(hooks), head=type(head).__name__))
    return out


def _version(value: Any) -> Optional[int]:
    # An inference tensor (``torch.inference_mode``) has no version counter.
    return value._version if isinstance(value, torch.Tensor) and not value.is_inference() else None


def _is_the_loss(out: Any, loss: Any, version: Optional[int]) -> bool:
    """Whether the head's call returned the loss unchanged: itself, or handed on by torch's full backward hooks
    (a global one wraps every module's output in ``BackwardHookFunction``, a new tensor over the same one)."""
    if out is not loss:
        grad_fn: Any = getattr(out, "grad_fn", None)
        wrapped = type(grad_fn) is BackwardHookFunction._backward_cls
        if not wrapped or grad_fn.next_functions[0][0] is not loss.grad_fn:
            return False
    return _version(out) == version


def _backend(lm_head: nn.Module, fixed: Optional[Strategy]) -> Tuple[Strategy, Any, List[torch.Tensor]]:
    """The head's backend (checked), its ``vocab_slice`` (None: it does not split the vocabulary), and the head's
    DTensor parameters."""
    backend = fixed if fixed is not None else resolve_strategy(lm_head)
    backend.check_supported(lm_head)
    dtensors: List[torch.Tensor] = [p for p in lm_head.parameters() if type(p).__name__ == "DTensor"]
    return backend, getattr(backend, "vocab_slice", None), dtensors


def loss_as_op(lm_head: nn.Module, strategy: StrategyArg, has_group: bool) -> bool:
    """Whether a traced call of the tiled loss may be the one op: a plain ``nn.Linear`` head, whole on this
    rank, without hooks, outside autocast, whose backend neither gathers parameters nor delivers gradients."""
    if has_group or not is_plain_linear(lm_head):
        return False
    backend, splits_vocab, dtensors = _backend(lm_head, strategy_from_arg(strategy))
    if (splits_vocab is not None or dtensors or not autograd_carries_the_call(backend) or hook_count(lm_head)
            or global_hook_count()):  # the op calls no module: a hook for every module would miss the head's call
        return False
    weight: torch.Tensor = lm_head.weight  # type: ignore[assignment]  # read last: ZeRO-3 gathers it on access
    return not autocast_enabled(weight.device.type)


def global_hook_count() -> int:
    """The hooks registered for every module (``register_module_forward_hook``...); read in traced code, so that
    Dynamo may guard the count."""
    return sum(len(getattr(_module_globals, name)) for name in GLOBAL_HOOK_DICTS)


@dynamo_support.decided_where_traced
def _traced_as_op(lm_head: nn.Module, strategy: Any, has_group: bool, hooks: int, global_hooks: int) -> bool:
    """``hooks`` and ``global_hooks`` are passed so that Dynamo guards the counts."""
    return loss_as_op(lm_head, strategy, has_group)


def _traced_linear_loss(hidden, lm_head, labels, shift_labels, options: CrossEntropyOptions, reduction: str,
                        num_items_in_batch, num_shards: NumShards, grad_accum_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The loss of a plain linear head as Dynamo traces it: the eager loss's targets and denominator, the shards
    in one op."""
    weight: torch.Tensor = lm_head.weight
    bias: Optional[torch.Tensor] = lm_head.bias
    targets = _shifted_targets(hidden, labels, shift_labels, options.ignore_index)
    scale = _scale(targets, reduction, num_items_in_batch, options.ignore_index, loss_dtype(weight.dtype), None)
    grad = torch.is_grad_enabled()
    loss, *_ = linear_cross_entropy(
        hidden, targets, scale, weight, bias, options.ignore_index, options.label_smoothing, options.logit_softcap,
        options.z_loss, loss_num_shards(targets.numel(), weight.shape[0], num_shards), grad_accum_dtype,
        grad and hidden.requires_grad, grad and weight.requires_grad, grad and bias is not None and bias.requires_grad)
    return loss


@dataclass(eq=False)  # compared and hashed by identity
class LossSite:
    """The loss's decision and run for ``tiled_call``."""

    owner: nn.Module
    backend: Strategy
    targets: torch.Tensor
    options: CrossEntropyOptions
    scale_of: Callable[[torch.dtype], torch.Tensor]  # ``_scale`` in a loss dtype
    num_shards: NumShards
    grad_accum_dtype: Optional[torch.dtype]
    # This rank's view of a head whose vocabulary is split over ranks; None: the head is whole here.
    vocab_slice: Optional[VocabSlice] = None
    hidden: Optional[torch.Tensor] = None

    def loss_of(self, head_input: torch.Tensor) -> torch.Tensor:
        self.hidden = head_input
        return tiled_call(self.owner, self.backend, self.decide, self.run, self.grad_accum_dtype)

    def decide(self, strategy: Strategy) -> CallDecision:
        lm_head, targets, x, split = self.owner, self.targets, self.hidden, self.vocab_slice
        assert x is not None, "decided inside the head's call"
        if split is None:
            trainable = strategy.trainable_params(lm_head)
        else:
            trainable = [t for t in (split.weight, split.bias) if t is not None and t.requires_grad]
        choice = choose_kernel(REDUCE, KernelCall(lm_head, x, strategy, trainable, options=self.options,
                                                  vocab_slice=split))
        if choice.entry is None:
            raise RuntimeError(f"tiled loss: no registered kernel computes the loss of {type(lm_head).__name__}: "
                               f"{choice.describe()}")
        # DeepSpeed AutoTP's gathering lm_head holds a slice of the vocabulary whose logits hold all of it.
        vocab = _vocab_size(lm_head) if strategy.head_call(lm_head).weight_is_whole else None
        if vocab is not None:  # else the module kernel checks each shard once its logits show the vocabulary
            check_targets(targets, vocab, self.options.ignore_index)
        # A split vocabulary: sized on the widest rank, so that every rank runs the same shards and collectives.
        columns = split.max_rows if split is not None else vocab or UNKNOWN_VOCAB
        num_shards = loss_num_shards(targets.numel(), columns, self.num_shards)
        return CallDecision(choice.describe(), choice.kernel, choice.name, targets.numel(), num_shards, trainable)

    def run(self, run: ShardedRun) -> torch.Tensor:
        x, params = self.hidden, run.kernel.params
        assert x is not None
        return sharded_reduce(x, self.targets, self.scale_of(loss_dtype(params[0].dtype if params else x.dtype)), run,
                              params)


class TiledCrossEntropy(nn.Module):
    """The module form of ``tiled_cross_entropy``: the options here, the tensors at the call
    (``loss_fn(hidden, lm_head, labels)``), as ``nn.CrossEntropyLoss``. It holds no parameters."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 logit_softcap: Optional[float] = None, z_loss: float = 0.0, num_shards: NumShards = AUTO,
                 strategy: StrategyArg = "auto", grad_accum_dtype: Optional[torch.dtype] = None,
                 sequence_group: Optional[Any] = None):
        super().__init__()
        _options(ignore_index, label_smoothing, logit_softcap, z_loss, reduction, num_shards)  # validates them
        strategy_from_arg(strategy)
        self.options: Dict[str, Any] = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                                            logit_softcap=logit_softcap, z_loss=z_loss, num_shards=num_shards,
                                            strategy=strategy, grad_accum_dtype=grad_accum_dtype,
                                            sequence_group=sequence_group)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module, labels: Optional[torch.Tensor] = None, *,
                shift_labels: Optional[torch.Tensor] = None,
                num_items_in_batch: Optional[Union[int, torch.Tensor]] = None) -> torch.Tensor:
        return tiled_cross_entropy(hidden, lm_head, labels, shift_labels=shift_labels,
                                   num_items_in_batch=num_items_in_batch, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


def _options(ignore_index: int, label_smoothing: float, logit_softcap: Optional[float], z_loss: float, reduction: str,
             num_shards: NumShards) -> CrossEntropyOptions:
    options = CrossEntropyOptions(ignore_index, float(label_smoothing), logit_softcap, float(z_loss))
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r} (the tiled loss returns no per-token "
                         "losses: that would be a [tokens] tensor computed from the logits it never holds)")
    check_num_shards(num_shards)
    return options


def _shifted_targets(hidden, labels, shift_labels, ignore_index: int) -> torch.Tensor:
    given = shift_labels if shift_labels is not None else labels
    if tuple(given.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"tiled loss: labels of shape {tuple(given.shape)} do not match hidden states of shape "
                         f"{tuple(hidden.shape)}; labels are [..., tokens]")
    if shift_labels is not None:
        return shift_labels.to(hidden.device, torch.long)
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(hidden.device, torch.long)


def _declared_width(lm_head: nn.Module, name: str, weight_dim: int) -> Optional[int]:
    """The head's ``in_features`` / ``out_features`` where its 2-D weight agrees (always on an ``nn.Linear``):
    PEFT's ``modules_to_save`` on a tied embedding reports the embedding's sizes, swapped."""
    value = getattr(lm_head, name, None)
    if not isinstance(value, int):
        return None
    if isinstance(lm_head, nn.Linear):  # its weight unread: ZeRO-3 gathers a parameter read as an attribute
        return value
    weight = getattr(lm_head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[weight_dim] != value:
        return None
    return value


def _vocab_size(lm_head: nn.Module) -> Optional[int]:
    if isinstance(getattr(lm_head, "out_features", None), int):
        return _declared_width(lm_head, "out_features", 0)
    weight = getattr(lm_head, "weight", None)
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _scale(targets: torch.Tensor, reduction: str, num_items_in_batch, ignore_index: int,
           dtype: torch.dtype, group: Optional[Any]) -> torch.Tensor:
    """1 / the denominator, as a tensor (no host sync)."""
    if num_items_in_batch is not None:
        denominator = torch.as_tensor(num_items_in_batch, device=targets.device).to(dtype)
    elif reduction == "mean" and group is not None:
        denominator = group_count(targets, ignore_index, group, dtype)
    elif reduction == "mean":
        denominator = (targets != ignore_index).sum().to(dtype)  # 0 valid tokens: NaN, as F.cross_entropy
    else:
        denominator = torch.ones((), dtype=dtype, device=targets.device)
    return denominator.reciprocal()
