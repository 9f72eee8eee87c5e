"""Each trainable parameter's gradient is accumulated exactly once per backward, whatever the shard
count: the contract DDP's reducer, FSDP2's reduce-scatter and ZeRO's gradient hooks rely on."""
from __future__ import annotations

from collections import Counter

import pytest
from reference import FusedGatedMLP, GatedMLP, PlainMLP, fresh_inputs, lora_gated, seeded

from tiled_mlp import TiledMLP

pytestmark = pytest.mark.timeout(60)

HIDDEN, INTER, TOKENS = 8, 12, 7


def count_accumulations(mlp):
    counts = Counter()
    for name, p in mlp.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p, name=name: counts.update([name]))
    return counts


CASES = {
    "gated-fast": (lambda: GatedMLP(HIDDEN, INTER, bias=True), "fast"),
    "fused-fast": (lambda: FusedGatedMLP(HIDDEN, INTER, bias=True), "fast"),
    "gated-generic": (lambda: GatedMLP(HIDDEN, INTER, bias=True), "generic"),
    "plain-generic": (lambda: PlainMLP(HIDDEN, INTER, dropout=0.2), "generic"),
    "lora-generic": (lambda: lora_gated(HIDDEN, INTER), "auto"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_shards", [1, 2, 3, 7, 14, 30])
@pytest.mark.parametrize("input_grad", [True, False])
def test_one_accumulation_per_parameter_per_backward(case, num_shards, input_grad):
    builder, path = CASES[case]
    mlp = seeded(builder, 0)
    counts = count_accumulations(mlp)
    trainable = {n for n, p in mlp.named_parameters() if p.requires_grad}
    tiled = TiledMLP(mlp, num_shards=num_shards, path=path)
    for step in (1, 2):  # the second backward accumulates into existing .grad: still one each
        x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=step, requires_grad=input_grad)
        tiled(x).backward(dy)
        assert dict(counts) == {name: step for name in trainable}
    assert all(p.grad is None for p in mlp.parameters() if not p.requires_grad)
