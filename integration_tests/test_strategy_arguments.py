"""Strategy instances carry their backend's process group, and a loss split across ranks asks them.

Two gloo processes, one spawned run. Each rank holds its own one-rank group and the two-rank group:

- "auto" under DDP returns a ``DDPStrategy`` configured with the wrapper's process group;
- a ``DDPStrategy(process_group=own)`` given to the sequence-parallel check is used as given: DDP
  averaging over one rank leaves the other SP rank out, refused; over both ranks, accepted;
- the same group registered with ``register_strategy(DDPStrategy, process_group=...)`` reaches the tiled
  loss's check end to end (the registry's stored arguments);
- a third-party strategy that claims the head but lacks ``SequenceParallelAware`` is refused by the tiled
  loss under SP; the same strategy with the capability runs, and the loss equals the float64 loss of the
  whole sequence on one process.
"""
from __future__ import annotations

from typing import Dict, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

WORLD = 2
HIDDEN, INTER, VOCAB, TOKENS = 8, 12, 11, 6  # TOKENS per rank
MARK = "_test_marked_head"


def whole_sequence():
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, WORLD * TOKENS, HIDDEN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (1, WORLD * TOKENS), generator=generator)
    labels[0, 3] = -100
    head = nn.Linear(HIDDEN, VOCAB, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator, dtype=torch.float64))
    return hidden, labels, head


def refusal(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the message is what is compared
        return f"{type(error).__name__}: {error}"
    return ""


def strategy_argument_ranks(rank: int, world_size: int) -> Dict[str, object]:
    from tiled_mlp import TiledMLP
    from tiled_mlp.core import tiled_cross_entropy
    from tiled_mlp.strategies import (
        DDPStrategy,
        SequenceParallelAware,
        Strategy,
        register_strategy,
        unregister_strategy,
    )
    from tiled_mlp.strategies.resolver import resolve_strategy as head_strategy
    from tiled_mlp.strategies.resolver import sums_over_sequence_ranks

    from .toy_models import GatedMLP

    own = [dist.new_group([r]) for r in range(world_size)][rank]
    both = dist.new_group(list(range(world_size)))
    out: Dict[str, object] = {}

    # "auto" under DDP: the instance carries the wrapper's process group.
    torch.manual_seed(0)
    model = nn.Sequential(GatedMLP(HIDDEN, INTER)).double()
    tiled = TiledMLP(model[0], num_shards=2)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=both)
    ddp(torch.randn(1, TOKENS, HIDDEN, dtype=torch.float64)).sum().backward()
    out["auto_name"] = tiled.tiling.last_strategy.name
    out["auto_group_is_the_wrappers"] = getattr(tiled.tiling.last_strategy, "process_group", None) is ddp.process_group

    hidden, labels, head = whole_sequence()
    shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    my_hidden, my_labels = hidden[:, mine], shift_labels[:, mine].contiguous()

    # A given instance, used as given.
    out["given_own"] = refusal(lambda: sums_over_sequence_ranks(head, both, strategy=DDPStrategy(process_group=own)))
    out["given_both"] = refusal(lambda: sums_over_sequence_ranks(head, both, strategy=DDPStrategy(process_group=both)))

    # A registered instance's stored group reaches the loss's check.
    def registered_own() -> None:
        register_strategy(DDPStrategy, process_group=own, override=True)
        try:
            tiled_cross_entropy(my_hidden, head, shift_labels=my_labels, sequence_group=both)
        finally:
            register_strategy(DDPStrategy, override=True)

    out["registered_own"] = refusal(registered_own)

    class ClaimsMarkedHead(Strategy):
        name = "test_claims_marked_head"
        priority = 500

        @classmethod
        def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
            return any(getattr(p, MARK, False) for p in module.parameters())

    class AwareClaimsMarkedHead(SequenceParallelAware, ClaimsMarkedHead):
        name = "test_aware_claims_marked_head"

    setattr(head.weight, MARK, True)
    register_strategy(ClaimsMarkedHead)
    try:
        out["unaware"] = refusal(lambda: tiled_cross_entropy(my_hidden, head, shift_labels=my_labels,
                                                             sequence_group=both))
    finally:
        unregister_strategy(ClaimsMarkedHead.name)
    register_strategy(AwareClaimsMarkedHead)
    try:
        loss = tiled_cross_entropy(my_hidden, head, shift_labels=my_labels, sequence_group=both, num_shards=2)
        out["aware_loss"] = loss.detach()
        out["aware_resolved"] = type(head_strategy(head)).__name__
    finally:
        unregister_strategy(AwareClaimsMarkedHead.name)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(strategy_argument_ranks, WORLD, tmp_path_factory.mktemp("strategy_arguments"), timeout=90)


def test_auto_under_ddp_returns_an_instance_with_the_wrappers_process_group(ranks):
    for got in ranks:
        assert got["auto_name"] == "ddp" and got["auto_group_is_the_wrappers"], got


def test_a_given_process_group_is_used_for_the_sequence_parallel_check(ranks):
    for rank, got in enumerate(ranks):
        assert got["given_own"].startswith("UnsupportedBackendError"), got["given_own"]
        assert f"DDP averages the gradients of Linear over ranks [{rank}]" in got["given_own"], got["given_own"]
        assert got["given_both"] == "", got["given_both"]


def test_a_registered_process_group_reaches_the_tiled_loss(ranks):
    for rank, got in enumerate(ranks):
        assert f"DDP averages the gradients of Linear over ranks [{rank}]" in got["registered_own"], got["registered_own"]


def test_the_tiled_loss_refuses_a_claiming_strategy_without_the_capability_under_sp(ranks):
    for got in ranks:
        assert "'test_claims_marked_head' (ClaimsMarkedHead) claims Linear, but does not implement the " \
               "SequenceParallelAware capability" in got["unaware"], got["unaware"]


def test_a_claiming_strategy_with_the_capability_gives_the_whole_sequences_loss(ranks):
    hidden, labels, head = whole_sequence()
    with torch.no_grad():
        logits = head(hidden)[:, :-1].reshape(-1, VOCAB)
        want = F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    for got in ranks:
        assert got["aware_resolved"] == "AwareClaimsMarkedHead", got["aware_resolved"]
        error = float((got["aware_loss"] - want).abs() / want.abs())
        assert error <= 1e-12, error
