"""The tiled causal-LM loss: output head + cross-entropy over token shards, never holding the logits.

``tiled_cross_entropy(hidden, lm_head, labels)`` equals Hugging Face's ``ForCausalLMLoss`` on
``lm_head(hidden)`` (labels shifted the same way, ``ignore_index``, the mean over valid tokens or the sum
over ``num_items_in_batch``, float32 loss math from low-precision weights), and adds what that loss
leaves to the model: ``logit_softcap`` (Gemma 2), ``label_smoothing`` (as ``F.cross_entropy``'s) and
``z_loss``. No ``[tokens, vocab]`` tensor outlives one shard, and no logits are returned.

It is a caller of the one tiled call (``tiled_call``, as a tiled MLP is), of the reduction shape
(``sharded_reduce``, beside the MLP's token-wise map): its kernel is chosen from the registry
(``kernel_registry``: the linear head, else the module head), and the gradients reach the backend
through the same single delivery. The loss runs as the forward of one call of the head
(``head_call.py``), so a backend's module hooks on the head surround it as they surround
``lm_head(hidden)``: ZeRO-3 gathers a partitioned ``lm_head`` before the loss and releases it after,
gathers it again when the loss's gradient arrives and releases it once the hidden states' gradient is
out. Inside, the strategy's ``gathered`` region surrounds the shard loop (never one gather per shard).
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from tiled_mlp.strategies.base import Strategy
from tiled_mlp.strategies.resolver import StrategyArg, resolve_strategy, strategy_from_arg, sums_over_sequence_ranks

from . import dynamo_support
from .compiled_loss import traced_loss_route
from .head_call import foreign_head_hooks, in_head_call
from .kernel_registry import REDUCE, KernelCall, choose_kernel
from .kernels.cross_entropy import CrossEntropyOptions, check_targets
from .kernels.lm_head import loss_dtype
from .kernels.vocab_parallel import SplitsHeadVocabulary, VocabSlice
from .loss_shards import loss_num_shards
from .ops.linear_cross_entropy import linear_cross_entropy
from .sequence_group import check_group, group_count, sum_over_group
from .shard_plan import AUTO, NumShards, ShardPlan, check_num_shards
from .sharded_autograd import ShardedRun, sharded_reduce
from .tiled_call import CallDecision, tiled_call

REDUCTIONS = ("mean", "sum")
# A head whose vocabulary cannot be read before it runs (a module without ``out_features`` or a 2-D
# ``weight``): "auto" sizes its shards for a vocabulary this large (Llama 3's is 128256), so that a
# shard's logits stay within the budget for any common head, smaller ones only shard finer than needed.
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
    """The causal-LM loss of ``lm_head(hidden)`` against ``labels``, computed a token shard at a time.

    Args:
        hidden: ``[..., tokens, hidden]``, the final hidden states (after the last norm).
        lm_head: the output head (``nn.Linear``, tied to the embeddings or not, with or without a bias;
            or any module mapping hidden states to logits, such as PEFT's LoRA ``lm_head``).
        labels: ``[..., tokens]`` token ids, shifted here as ``ForCausalLMLoss`` shifts them (position t
            predicts label t + 1). Or give ``shift_labels`` already shifted (sequence parallelism splits
            the sequence after shifting); given both, ``shift_labels`` is used, as Hugging Face does.
        ignore_index: labels to skip (-100).
        reduction: "mean" over the valid tokens, or "sum". ``num_items_in_batch`` (the Trainer's
            gradient-accumulation count) overrides it: the sum divided by that count, as Hugging Face.
        label_smoothing: as ``F.cross_entropy``'s.
        logit_softcap: ``c``: logits ``c * tanh(logits / c)`` (Gemma 2's ``final_logit_softcapping``).
        z_loss: ``lam``: adds ``lam * logsumexp(logits) ** 2`` per valid token (PaLM's z-loss).
        num_shards: an int >= 1, or "auto" (a shard's float32 logits near 256 MiB).
        strategy: "auto" (the head's backend, resolved now), a registered name or a ``Strategy``.
        grad_accum_dtype: dtype of the head's gradient sums over shards (default: the parameter's).
        sequence_group: the process group a sequence is split across (sequence parallelism: this rank
            holds a slice of the tokens, its labels already shifted). The loss is summed per rank and
            divided once, by the valid tokens of the whole group (or ``num_items_in_batch``, the count of
            everything one optimizer step sums over), and every rank returns the whole sequence's loss
            (``sequence_group.py``; its backward hands each rank what the backend's reduction over the
            ranks turns into the whole sequence's gradient: ``SequenceParallelAware.sums_over_sequence_ranks``).
        model: the model ``lm_head`` belongs to, whose backend that question is asked of (default:
            ``lm_head`` alone, which cannot answer for a frozen head under ZeRO-1/2).

    Returns: a 0-dim tensor in float32 (float64 for a float64 head). Every gradient, the head's included,
    is scaled by the gradient that reaches it.
    """
    options = CrossEntropyOptions(ignore_index, float(label_smoothing), logit_softcap, float(z_loss))
    _check_labels(hidden, labels, shift_labels)
    _check_call(hidden, lm_head, options, reduction)
    check_num_shards(num_shards)
    if sequence_group is not None:
        check_group(sequence_group)
        if shift_labels is None:  # a slice's labels shifted within the slice would lose each slice's last target
            raise ValueError("tiled loss: under sequence parallelism give shift_labels, shifted over the whole sequence "
                             "before it was split (the sequence-parallel sharding step makes them); labels would be "
                             "shifted within this rank's slice")
    if torch.compiler.is_compiling():
        # Traced by torch.compile: one op where the head and its backend allow it, else this function run
        # eagerly behind one graph break (``compiled_loss``).
        if traced_loss_route(lm_head, strategy, sequence_group is not None).as_op:
            return _traced_linear_loss(hidden, lm_head, labels, shift_labels, options, reduction, num_items_in_batch,
                                       num_shards, grad_accum_dtype)
        return _eager_tiled_cross_entropy(
            hidden, lm_head, labels, shift_labels=shift_labels, ignore_index=ignore_index, reduction=reduction,
            num_items_in_batch=num_items_in_batch, label_smoothing=label_smoothing, logit_softcap=logit_softcap,
            z_loss=z_loss, num_shards=num_shards, strategy=strategy, grad_accum_dtype=grad_accum_dtype,
            sequence_group=sequence_group, model=model)
    fixed = strategy_from_arg(strategy)
    # Before any work: a backend that cannot carry a loss split across the group refuses here, the
    # strategy given to this call among them.
    averages = sequence_group is None or not sums_over_sequence_ranks(model if model is not None else lm_head,
                                                                      sequence_group, fixed)
    backend = fixed if fixed is not None else resolve_strategy(lm_head)
    backend.check_supported(lm_head)
    splits_vocab = isinstance(backend, SplitsHeadVocabulary)
    dtensors = [p for p in lm_head.parameters() if _is_dtensor(p)]
    if dtensors and not splits_vocab and not backend.head_call_gathers(lm_head):
        raise RuntimeError(SHARDED_WEIGHT_ERROR.format(head=type(lm_head).__name__, layout=_layout(dtensors[0]),
                                                       strategy=backend.name))
    foreign = foreign_head_hooks(lm_head, functools.partial(backend.is_head_call_hook, lm_head))
    if foreign:
        raise RuntimeError(HEAD_HOOKS_ERROR.format(head=type(lm_head).__name__, hooks=", ".join(foreign)))
    if splits_vocab:
        # This rank's rows of the head and the hidden states as the head's own input hook makes them (a
        # sequence-parallel input is gathered there): the labels are the tokens the head sees.
        vocab_slice = backend.vocab_slice(lm_head, hidden)  # type: ignore[attr-defined]  # SplitsHeadVocabulary
        targets = _shifted_targets(vocab_slice.hidden, labels, shift_labels, ignore_index)
        site = LossSite(lm_head, backend, targets, options, reduction, num_items_in_batch, num_shards,
                        grad_accum_dtype, sequence_group, vocab_slice)
        # The head's hooks are the style's own, which the slice stands in for: the head is not called.
        return site.loss_of(vocab_slice.hidden)
    targets = _shifted_targets(hidden, labels, shift_labels, ignore_index)
    site = LossSite(lm_head, backend, targets, options, reduction, num_items_in_batch, num_shards, grad_accum_dtype,
                    sequence_group)
    # Inside the head's own call: a backend's hooks on the head (ZeRO-3's gather and release, forward and
    # backward) surround the loss, as they surround ``lm_head(hidden)`` (``head_call.py``).
    loss = in_head_call(lm_head, hidden, site.loss_of, backend.head_call_sees_graph(lm_head))
    return sum_over_group(loss, sequence_group, averages)


_eager_tiled_cross_entropy = dynamo_support.disable(tiled_cross_entropy)


def _traced_linear_loss(hidden: torch.Tensor, lm_head: nn.Module, labels: Optional[torch.Tensor],
                        shift_labels: Optional[torch.Tensor], options: CrossEntropyOptions, reduction: str,
                        num_items_in_batch, num_shards: NumShards, grad_accum_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The loss of a plain linear head as Dynamo traces it: the targets and the denominator as the eager
    loss forms them, the shards in one op that forms the gradients the call needs."""
    # A plain nn.Linear (``compiled_loss`` decided it).
    weight: torch.Tensor = lm_head.weight  # type: ignore[assignment]
    bias: Optional[torch.Tensor] = lm_head.bias  # type: ignore[assignment]
    targets = _shifted_targets(hidden, labels, shift_labels, options.ignore_index)
    scale = _scale(targets, reduction, num_items_in_batch, options.ignore_index, loss_dtype(weight.dtype), None)
    grad = torch.is_grad_enabled()
    loss, *_ = linear_cross_entropy(
        hidden, targets, scale, weight, bias, options.ignore_index, options.label_smoothing, options.logit_softcap,
        options.z_loss, loss_num_shards(targets.numel(), weight.shape[0], num_shards), grad_accum_dtype,
        grad and hidden.requires_grad, grad and weight.requires_grad, grad and bias is not None and bias.requires_grad)
    return loss


class LossSite:
    """The loss's side of ``tiled_call``: a ``sharded_reduce`` over the hidden states. Its strategy was
    resolved and checked before the head's call (a refusal comes before any work)."""

    def __init__(self, lm_head: nn.Module, backend: Strategy, targets: torch.Tensor, options: CrossEntropyOptions,
                 reduction: str, num_items_in_batch, num_shards: NumShards, grad_accum_dtype: Optional[torch.dtype],
                 sequence_group: Optional[Any], vocab_slice: Optional[VocabSlice] = None):
        self.owner = lm_head
        # This rank's view of a head whose vocabulary is split over ranks (the kernel computes with it
        # alone: its tensors are the ones owed gradients); None: the head is whole here.
        self.vocab_slice = vocab_slice
        self.backend = backend
        self.targets = targets
        self.options = options
        self.reduction = reduction
        self.num_items_in_batch = num_items_in_batch
        self.num_shards = num_shards
        self.grad_accum_dtype = grad_accum_dtype
        self.sequence_group = sequence_group
        self.hidden: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None
        self.params: List[torch.Tensor] = []

    def loss_of(self, head_input: torch.Tensor) -> torch.Tensor:
        """The head's forward for this one call (``head_call.in_head_call`` runs it)."""
        self.hidden = head_input
        return tiled_call(self)

    def strategy(self) -> Strategy:
        return self.backend

    def decide(self, strategy: Strategy) -> CallDecision:
        lm_head, targets, x = self.owner, self.targets, self.hidden
        assert x is not None, "decided inside the head's call"
        split = self.vocab_slice
        if split is None:
            trainable = strategy.trainable_params(lm_head)
        else:
            trainable = [t for t in (split.weight, split.bias) if t is not None and t.requires_grad]
        choice = choose_kernel(REDUCE, KernelCall(lm_head, x, strategy, trainable, options=self.options,
                                                  vocab_slice=split))
        if choice.entry is None:
            raise RuntimeError(f"tiled loss: no registered kernel computes the loss of {type(lm_head).__name__}: "
                               f"{choice.describe()}")
        self.params = list(choice.kernel.params)
        dtype = loss_dtype(self.params[0].dtype if self.params else x.dtype)
        # A head whose weight holds a slice of the vocabulary but whose logits hold all of it (DeepSpeed AutoTP's
        # gathering lm_head): the vocabulary shows in the logits only.
        vocab = _vocab_size(lm_head) if strategy.head_weight_is_whole(lm_head) else None
        if vocab is not None:  # else the module kernel checks each shard once its logits show the vocabulary
            check_targets(targets, vocab, self.options.ignore_index)
        self.scale = _scale(targets, self.reduction, self.num_items_in_batch, self.options.ignore_index, dtype,
                            self.sequence_group)
        num_tokens = targets.numel()
        # A split vocabulary: a shard's logits are one rank's columns (sized on the widest rank, so that
        # every rank runs the same shards and the same collectives).
        columns = split.max_rows if split is not None else vocab or UNKNOWN_VOCAB
        num_shards = loss_num_shards(num_tokens, columns, self.num_shards)
        return CallDecision(choice.describe(), choice.kernel, choice.name, num_tokens, num_shards, trainable)

    def untiled(self, decision: CallDecision) -> torch.Tensor:
        raise AssertionError("the loss always runs tiled")  # its decision always names a kernel

    def run(self, run: ShardedRun) -> torch.Tensor:
        assert self.hidden is not None and self.scale is not None
        return sharded_reduce(self.hidden, self.targets, self.scale, run, self.params)

    def record(self, decision: CallDecision, plan: Optional[ShardPlan]) -> None:
        """The loss keeps no report (it is a function, with no state of its own)."""


class TiledCrossEntropy(nn.Module):
    """The module form of ``tiled_cross_entropy``: the options here, the tensors at the call
    (``loss_fn(hidden, lm_head, labels)``), as ``nn.CrossEntropyLoss``. It holds no parameters."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 logit_softcap: Optional[float] = None, z_loss: float = 0.0, num_shards: NumShards = AUTO,
                 strategy: StrategyArg = "auto", grad_accum_dtype: Optional[torch.dtype] = None,
                 sequence_group: Optional[Any] = None):
        super().__init__()
        CrossEntropyOptions(ignore_index, float(label_smoothing), logit_softcap, float(z_loss))  # validates them
        _check_reduction(reduction)
        loss_num_shards(0, 1, num_shards)  # validates num_shards now
        strategy_from_arg(strategy)
        self.options: Dict[str, Any] = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                            logit_softcap=logit_softcap, z_loss=z_loss, num_shards=num_shards, strategy=strategy,
                            grad_accum_dtype=grad_accum_dtype, sequence_group=sequence_group)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module, labels: Optional[torch.Tensor] = None, *,
                shift_labels: Optional[torch.Tensor] = None,
                num_items_in_batch: Optional[Union[int, torch.Tensor]] = None) -> torch.Tensor:
        return tiled_cross_entropy(hidden, lm_head, labels, shift_labels=shift_labels,
                                   num_items_in_batch=num_items_in_batch, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


# -- checks, all made before any work --------------------------------------------------------------------
def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r} (the tiled loss returns no per-token "
                         "losses: that would be a [tokens] tensor computed from the logits it never holds)")


def _check_labels(hidden, labels, shift_labels) -> None:
    """Their presence and types (their shape is checked against the tokens the head sees)."""
    if labels is None and shift_labels is None:
        raise ValueError("tiled loss: pass labels (shifted here: position t predicts t+1) or shift_labels (already shifted)")
    # Both given: shift_labels wins, as in ForCausalLMLoss (the Trainer passes both under context and
    # sequence parallelism).
    given = shift_labels if shift_labels is not None else labels
    if not isinstance(given, torch.Tensor) or given.is_floating_point() or given.is_complex() or given.dtype == torch.bool:
        raise TypeError(f"tiled loss: labels must be an integer tensor, got {getattr(given, 'dtype', type(given).__name__)}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or not hidden.is_floating_point():
        raise ValueError("tiled loss: hidden must be a floating-point tensor of shape [..., tokens, hidden], got "
                         f"{getattr(hidden, 'shape', type(hidden).__name__)}")


def _shifted_targets(hidden, labels, shift_labels, ignore_index: int) -> torch.Tensor:
    given = shift_labels if shift_labels is not None else labels
    if tuple(given.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"tiled loss: labels of shape {tuple(given.shape)} do not match hidden states of shape "
                         f"{tuple(hidden.shape)}; labels are [..., tokens]")
    if shift_labels is not None:
        return shift_labels.to(hidden.device, torch.long)
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(hidden.device, torch.long)


def _check_call(hidden, lm_head, options: CrossEntropyOptions, reduction: str) -> None:
    if not isinstance(lm_head, nn.Module):
        raise TypeError(f"tiled loss: lm_head must be an nn.Module (the output head), got {type(lm_head).__name__}")
    _check_reduction(reduction)
    in_features = _declared_width(lm_head, "in_features", 1)
    if in_features is not None and hidden.shape[-1] != in_features:
        raise ValueError(f"tiled loss: hidden size {hidden.shape[-1]} does not match {type(lm_head).__name__}'s "
                         f"in_features {in_features}")


def _declared_width(lm_head: nn.Module, name: str, weight_dim: int) -> Optional[int]:
    """The head's ``name`` (``in_features``, ``out_features``) where it says what the head computes: on an
    ``nn.Linear`` always; on another head only where its 2-D weight agrees (dim ``weight_dim``). A wrapper can
    report another module's sizes (PEFT's ``modules_to_save`` on a tied embedding reports the embedding's,
    swapped); then None: the head's own forward checks its input, and its logits show the vocabulary."""
    value = getattr(lm_head, name, None)
    if not isinstance(value, int):
        return None
    if isinstance(lm_head, nn.Linear):
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
    """1 / the denominator, as a tensor (no host sync): Hugging Face's rules; under sequence parallelism
    the mean's count is the whole group's."""
    if num_items_in_batch is not None:
        denominator = torch.as_tensor(num_items_in_batch, device=targets.device).to(dtype)
    elif reduction == "mean" and group is not None:
        denominator = group_count(targets, ignore_index, group, dtype)
    elif reduction == "mean":
        denominator = (targets != ignore_index).sum().to(dtype)  # 0 valid tokens: NaN, as F.cross_entropy
    else:
        denominator = torch.ones((), dtype=dtype, device=targets.device)
    return denominator.reciprocal()


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _layout(t: torch.Tensor) -> str:
    """A DTensor's placements and mesh shape, read without importing DTensor into the core."""
    mesh = getattr(t, "device_mesh", None)
    return f"placements {tuple(getattr(t, 'placements', ()))} over a mesh of shape {tuple(getattr(mesh, 'shape', ()))}"
