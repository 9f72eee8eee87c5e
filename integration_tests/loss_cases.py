"""The tiled causal-LM loss (``tiled_cross_entropy``) under DDP, FSDP2 and DeepSpeed ZeRO 1/2/3: the
cases, the rank-side runs and the single-process float64 reference.

A tiny language model (embedding, tied to ``lm_head`` or not; a residual MLP; a final LayerNorm; an
``nn.Linear`` head without bias) computes its loss *inside its forward* with
``tiled_cross_entropy(..., num_shards=...)``, so the backend's hooks (DDP's forward, FSDP2's root unit,
ZeRO-3's module hooks) surround the call as in a real model.

The ranks hold different token counts (``TOKENS``) with different ignore masks, and every rank's loss is
``sum of its valid tokens' cross-entropy / N`` with ``N`` the *global* count of valid (shifted) labels,
all-reduced as the Trainer's ``num_items_in_batch`` is. The global loss is then the sum of the ranks'
losses. Every backend here *averages* gradients over ranks, so each rank back-propagates
``world_size * loss`` (what the Trainer does with ``average_tokens_across_devices``): the averaged
gradient is then the gradient of the global loss, which the reference computes in one process on all
ranks' data, untiled, in float64.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .comparison import ZERO_DTYPE
from .training_record import record_step, sgd_step

VOCAB = 37
HIDDEN = 16
TOKENS = (9, 23)  # tokens per rank (one sequence each)
MASKED = (0.25, 0.45)  # fraction of labels set to -100 on each rank: uneven ignore masks
STEPS = 2  # SGD steps per run: the second forward runs after the backend's first step (ZeRO-3's trace)
LR = 0.1
DTYPE = torch.float64
IGNORE = -100


@dataclass(frozen=True)
class LossCase:
    name: str
    backend: str  # "ddp", "fsdp2", "zero1", "zero2", "zero3"
    tied: bool  # lm_head.weight is embed_tokens.weight
    empty_rank: bool = False  # rank 0's labels are all -100: no valid token there
    tiled: bool = True  # False: the same model with the untiled float64 loss (checks the harness)

    def shards(self, rank: int) -> int:
        # With an empty rank the two ranks also tile differently (3 and 5 shards): no collective may
        # depend on the shard count.
        return (3, 5)[rank % 2] if self.empty_rank else 3

    @property
    def expected_strategy(self) -> str:
        return {"ddp": "ddp", "fsdp2": "fsdp2"}.get(self.backend, "deepspeed_zero")

    @property
    def zero_stage(self) -> Optional[int]:
        return int(self.backend[-1]) if self.backend.startswith("zero") else None


def loss_cases_for(backend: str, tied=(False, True), untiled_harness: bool = True) -> Tuple[LossCase, ...]:
    """The untiled harness case first (it must pass whatever the tiled ones do), then the tiled ones."""
    cases = [LossCase(f"{backend}-{'tied' if tied[-1] else 'untied'}-untiled", backend, tied=tied[-1], tiled=False)]
    cases = cases if untiled_harness else []
    for is_tied in tied:
        variant = f"{backend}-{'tied' if is_tied else 'untied'}"
        cases += [LossCase(variant, backend, tied=is_tied),
                  LossCase(f"{variant}-empty-rank", backend, tied=is_tied, empty_rank=True)]
    return tuple(cases)


# -- the model ----------------------------------------------------------------------------------------
class ResidualMLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def case_reference_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` with ``num_items_in_batch`` (shift, ignore_index, sum / N),
    without its ``logits.float()`` so that float64 stays float64 (the test checks it against the real
    ``ForCausalLMLoss`` in float32)."""
    shift = F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift, ignore_index=IGNORE, reduction="sum")
    return total / torch.as_tensor(num_items_in_batch).to(total.dtype)


class TinyLM(nn.Module):
    def __init__(self, tied: bool, tiled: bool, num_shards: int = 3):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layer = ResidualMLP(HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.tiled, self.num_shards = tiled, num_shards

    def forward(self, input_ids, labels, num_items_in_batch=None):
        from tiled_mlp.core import tiled_cross_entropy

        hidden = self.norm(self.layer(self.embed_tokens(input_ids)))
        if self.tiled:
            return tiled_cross_entropy(hidden, self.lm_head, labels, num_items_in_batch=num_items_in_batch,
                                       num_shards=self.num_shards)
        return case_reference_loss(self.lm_head(hidden), labels, num_items_in_batch)


def loss_model(tied: bool, tiled: bool = False, num_shards: int = 3, dtype: torch.dtype = DTYPE) -> TinyLM:
    """Seeded: every rank and the reference start from the same weights (float64; a DeepSpeed rank from
    their float32 rounding, ``comparison.ZERO_DTYPE``). The norm's affine parameters are moved off 1 and 0
    so that their gradients are not special."""
    torch.manual_seed(0)
    model = TinyLM(tied, tiled, num_shards)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.2, 0.2)
    return model.to(dtype)


# -- the data -----------------------------------------------------------------------------------------
def loss_batch(case: LossCase, step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of ``rank`` at ``step``, each ``[1, TOKENS[rank]]``."""
    g = torch.Generator().manual_seed(100 * step + rank + (7 if case.empty_rank else 0))
    tokens = TOKENS[rank % 2]
    ids = torch.randint(0, VOCAB, (1, tokens), generator=g)
    labels = ids.clone()
    labels[torch.rand(1, tokens, generator=g) < MASKED[rank % 2]] = IGNORE
    if case.empty_rank and rank == 0:
        labels.fill_(IGNORE)
    return ids, labels


def valid_count(labels: torch.Tensor) -> int:
    """Labels that count after the causal shift (position t predicts label t + 1)."""
    return int((labels[..., 1:] != IGNORE).sum())


def loss_global_count(case: LossCase, step: int, world: int) -> int:
    return sum(valid_count(loss_batch(case, step, rank)[1]) for rank in range(world))


# -- the single-process reference ---------------------------------------------------------------------
def loss_reference_run(case: LossCase, world: int) -> Dict:
    """Untiled float64, one process, all ranks' data: per step the global loss
    ``sum over ranks of sum(CE of valid tokens) / N``, its gradients, and the parameters after SGD."""
    model = loss_model(case.tied)
    named = list(model.named_parameters())
    optimizer = torch.optim.SGD([p for _, p in named], lr=LR)
    record: Dict = {"losses": [], "grads": [], "params": [], "counts": []}
    for step in range(STEPS):
        count = loss_global_count(case, step, world)
        loss = sum(model(*loss_batch(case, step, rank), num_items_in_batch=count) for rank in range(world))
        loss.backward()
        record["counts"].append(count)
        record_step(record, loss, named, sgd_step(optimizer))
    return record


# -- spies in the ranks -------------------------------------------------------------------------------
@contextlib.contextmanager
def tiled_loss_spy(calls: List[Dict]) -> Iterator[None]:
    """Records, per ``tiled_cross_entropy`` call, the strategy it resolved and its shard count."""
    import tiled_mlp.core.tiled_loss as tiled_loss

    resolve, decide = tiled_loss.resolve_strategy, tiled_loss.LossSite.decide

    def spy_resolve(module, *args, **kwargs):
        strategy = resolve(module, *args, **kwargs)
        calls.append({"strategy": strategy.name})
        return strategy

    def spy_decide(site, strategy):
        decision = decide(site, strategy)
        calls[-1].update(tokens=decision.num_tokens, shards=decision.num_shards)
        return decision

    tiled_loss.resolve_strategy, tiled_loss.LossSite.decide = spy_resolve, spy_decide  # type: ignore[method-assign]
    try:
        yield
    finally:
        tiled_loss.resolve_strategy, tiled_loss.LossSite.decide = resolve, decide  # type: ignore[method-assign]


def new_gather_counts() -> Dict:
    return {phase: {"regions": 0, "all_gathers": 0, "status_at_call": []} for phase in ("forward", "backward")}


@contextlib.contextmanager
def zero3_gather_spy(weight, counts: Dict, phase: str) -> Iterator[None]:
    """Counts, in ``counts[phase]``, for ZeRO-3's partitioned ``weight`` (lm_head's): the
    ``GatheredParameters`` regions entered with it, its ``all_gather`` calls (the per-parameter function
    every gather of it goes through: GatheredParameters', ZeRO's on-access fetch), and its status each
    time the strategy's ``gathered`` region is entered for a module holding it."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    from tiled_mlp.strategies.deepspeed_zero import DeepSpeedZeroStrategy

    enter, gathered = GatheredParameters.__enter__, DeepSpeedZeroStrategy.gathered
    all_gather = weight.all_gather
    record = counts[phase]

    def spy_enter(self):
        if self.enabled and any(p is weight for p in self.params):
            record["regions"] += 1
        return enter(self)

    def spy_all_gather(*args, **kwargs):
        record["all_gathers"] += 1
        return all_gather(*args, **kwargs)

    def spy_gathered(self, module):
        if any(p is weight for p in module.parameters()):
            record["status_at_call"].append(weight.ds_status.name)
        return gathered(self, module)

    GatheredParameters.__enter__, DeepSpeedZeroStrategy.gathered = spy_enter, spy_gathered
    weight.all_gather = spy_all_gather
    try:
        yield
    finally:
        GatheredParameters.__enter__, DeepSpeedZeroStrategy.gathered = enter, gathered
        weight.all_gather = all_gather


@contextlib.contextmanager
def _arrival_noted(case: LossCase, rank: int, weight) -> Iterator[None]:
    """A backward that fails says what the head's weight looked like when its gradient arrived (under
    ZeRO-3 it must be gathered, whole, for autograd to accumulate a whole gradient into it)."""
    arrivals: List[str] = []
    handle = weight.register_hook(lambda grad: arrivals.append(
        f"gradient {tuple(grad.shape)} arrived at a weight of shape {tuple(weight.shape)}, "
        f"ds_status {getattr(getattr(weight, 'ds_status', None), 'name', None)}"))
    try:
        yield
    except RuntimeError as exc:
        raise RuntimeError(f"{case.name}: backward failed on rank {rank}; the head's weight: {arrivals}") from exc
    finally:
        handle.remove()


@contextlib.contextmanager
def _no_spy(weight, counts: Dict, phase: str) -> Iterator[None]:
    yield


# -- the ranks ----------------------------------------------------------------------------------------
def _global_items(labels: torch.Tensor) -> torch.Tensor:
    """The Trainer's ``num_items_in_batch`` across data-parallel ranks: this rank's count, all-reduced."""
    count = torch.tensor(valid_count(labels), dtype=torch.int64)
    dist.all_reduce(count)
    return count


def _build_loss_case(case: LossCase, rank: int, world: int):
    """``(module to call, named parameters, torch optimizer or None, full grad, full param, DeepSpeed
    engine or None)``: ``full_*`` give a parameter's whole gradient / value after the backend's reduction."""
    model = loss_model(case.tied, tiled=case.tiled, num_shards=case.shards(rank),
                       dtype=ZERO_DTYPE if case.zero_stage else DTYPE)
    if case.backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        return wrapped, list(model.named_parameters()), optimizer, (lambda p: p.grad), (lambda p: p), None
    if case.backend == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # embed_tokens, norm and lm_head: the root's group
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        return model, list(model.named_parameters()), optimizer, (lambda p: p.grad.full_tensor()), \
            (lambda p: p.full_tensor()), None
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from .zero_cases import ZeroCase, zero_ds_config

    config = zero_ds_config(ZeroCase(case.name, stage=case.zero_stage, dtype=ZERO_DTYPE))
    config["gradient_clipping"] = 0.0  # DeepSpeed clips at 1.0 by default: the reference takes plain SGD steps
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)

    def full_param(p):
        master = safe_get_full_fp32_param(p)
        if master is not None:
            return master
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            return p.detach().clone()

    return engine, list(model.named_parameters()), None, safe_get_full_grad, full_param, engine


def run_loss_case(case: LossCase, rank: int, world: int) -> Dict:
    module, named, optimizer, full_grad, full_param, engine = _build_loss_case(case, rank, world)
    head_weight = dict(named)["embed_tokens.weight" if case.tied else "lm_head.weight"]
    record: Dict = {"losses": [], "grads": [], "params": [], "counts": [], "calls": [], "gathers": [],
                    "initial": {n: full_param(p).detach().clone() for n, p in named}}
    optimizer_step = engine.step if engine is not None else sgd_step(optimizer)
    for step in range(STEPS):
        ids, labels = loss_batch(case, step, rank)
        items = _global_items(labels)
        calls: List[Dict] = []
        gathers = new_gather_counts()
        spy = zero3_gather_spy if case.zero_stage == 3 else _no_spy
        with tiled_loss_spy(calls):
            with spy(head_weight, gathers, "forward"):
                loss = module(ids, labels, num_items_in_batch=items)
            # The backends average gradients over ranks; the loss is this rank's share of the *global*
            # loss (sum / global N), so world * loss makes the averaged gradient the global loss's.
            with spy(head_weight, gathers, "backward"), _arrival_noted(case, rank, head_weight):
                if engine is not None:
                    engine.backward(loss * world)
                else:
                    (loss * world).backward()
        record["counts"].append(int(items))
        record["calls"].append(calls)
        record["gathers"].append(gathers)
        record_step(record, loss, named, optimizer_step, full_grad, full_param)
    if case.backend == "fsdp2":
        record["outside_forward"] = _call_outside_fsdp2_forward(module, labels)
    if engine is not None:
        engine.destroy()
    return record


def _call_outside_fsdp2_forward(model, labels) -> Optional[str]:
    """Outside the root unit's forward lm_head's parameters are sharded DTensors: a clear error."""
    from tiled_mlp.core import tiled_cross_entropy

    hidden = torch.randn(*labels.shape, HIDDEN, dtype=DTYPE, requires_grad=True)
    try:
        tiled_cross_entropy(hidden, model.lm_head, labels, num_shards=3)
    except RuntimeError as exc:
        return str(exc)
    return None


def run_loss_cases(rank: int, world: int, cases: List[LossCase]) -> Dict[str, Dict]:
    if any(case.zero_stage for case in cases):
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
    results = {}
    for case in cases:
        results[case.name] = run_loss_case(case, rank, world)
        dist.barrier()
    return results
