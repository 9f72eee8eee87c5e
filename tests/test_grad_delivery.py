"""Each trainable parameter's gradient is accumulated exactly once per backward, whatever the shard
count: the contract DDP's reducer, FSDP2's reduce-scatter and ZeRO's gradient hooks rely on."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
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


class _CountingDoubler:
    """A tensor hook (``param.register_hook``) that doubles the gradient, as a per-parameter multiplier would."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, grad):
        self.calls += 1
        return grad * 2


def _doubled(module):
    hooks = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            hooks[name] = _CountingDoubler()
            p.register_hook(hooks[name])
    return hooks


def _tied_plain() -> PlainMLP:
    mlp = PlainMLP(HIDDEN, HIDDEN)
    mlp.fc2.weight = mlp.fc1.weight  # one tensor in two slots
    return mlp


class _ListReader(PlainMLP):
    """Reads fc1's weight through its slot and through a plain list as well (no slot there)."""

    def __init__(self) -> None:
        super().__init__(HIDDEN, INTER)
        self.refs = [self.fc1.weight]

    def forward(self, x):
        return super().forward(x) + (x @ self.refs[0].t()).sum(-1, keepdim=True)


# Without dropout: the untiled run draws other random numbers than the shards do.
HOOKED_CASES = {**CASES, "plain-generic": (lambda: PlainMLP(HIDDEN, INTER), "generic"),
                "tied-generic": (_tied_plain, "generic")}


@pytest.mark.parametrize("case", HOOKED_CASES)
@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_tensor_hook_on_each_parameter_runs_once_per_backward(case, num_shards):
    """Each shard's gradient is taken against a stand-in of the parameter: its hooks see the sum once, as untiled."""
    builder, path = HOOKED_CASES[case]
    reference, mlp = seeded(builder, 0), seeded(builder, 0)
    want, got = _doubled(reference), _doubled(mlp)
    tiled = TiledMLP(mlp, num_shards=num_shards, path=path)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=1)
    reference(x).backward(dy)
    tiled(x).backward(dy)
    assert {name: hook.calls for name, hook in got.items()} == {name: 1 for name in want}
    for (name, p), q in zip(reference.named_parameters(), mlp.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-12, msg=name)


def test_a_parameter_read_also_outside_its_slot_gets_its_whole_gradient():
    """The stand-in is read through the slot; a reference kept elsewhere still reaches the parameter itself."""
    reference, mlp = seeded(_ListReader, 0), seeded(_ListReader, 0)
    tiled = TiledMLP(mlp, num_shards=3, path="generic")
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=1)
    reference(x).backward(dy)
    tiled(x).backward(dy)
    for (name, p), q in zip(reference.named_parameters(), mlp.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-12, msg=name)


class _OutsideReader(PlainMLP):
    """Scales its output by a tensor that needs a gradient and is no parameter of it (held in a plain list)."""

    def __init__(self, scale) -> None:
        super().__init__(HIDDEN, INTER)
        self.scales = [scale]

    def forward(self, x):
        return super().forward(x) * self.scales[0]


@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_tensor_hook_on_a_tensor_read_outside_the_parameters_runs_once(num_shards):
    """A tensor with no parameter slot gets its stand-in at each torch call that reads it."""
    runs = []
    for tiled in (False, True):
        scale = torch.randn(HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
        hook = _CountingDoubler()
        scale.register_hook(hook)
        mlp = seeded(_OutsideReader, 0, scale)
        x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=1)
        (TiledMLP(mlp, num_shards=num_shards, path="generic") if tiled else mlp)(x).backward(dy)
        runs.append((hook.calls, scale.grad, mlp.fc1.weight.grad))
    (want_calls, *want), (calls, *got) = runs
    assert calls == want_calls == 1
    for have, expected in zip(got, want, strict=True):
        torch.testing.assert_close(have, expected, rtol=0, atol=1e-12)
