"""TiledMLP keeps the wrapped module's state_dict keys: untiled checkpoints load into tiled models and back."""
from __future__ import annotations

import pytest
import torch
from reference import FusedGatedMLP, GatedMLP, lora_gated
from torch import nn

from integration_tests.toy_models import ScaledBlock
from tiled_mlp import TiledMLP

pytestmark = pytest.mark.timeout(30)

HIDDEN, INTER = 8, 12


class Model(nn.Module):
    def __init__(self, builder, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(ScaledBlock(HIDDEN, builder(HIDDEN, INTER), 2.0) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def tile_model(model, **kwargs):
    for layer in model.layers:
        layer.mlp = TiledMLP(layer.mlp, **kwargs)
    return model


class HoldsAnMLP(nn.Module):
    """An MLP whose own child is called ``mlp``, the name TiledMLP gives the module it wraps."""

    def __init__(self, hidden, intermediate):
        super().__init__()
        self.mlp = GatedMLP(hidden, intermediate)
        self.register_buffer("gain", torch.tensor(1.5))

    def forward(self, x):
        return self.gain * self.mlp(x)


BUILDERS = {"gated": GatedMLP, "fused": FusedGatedMLP, "lora": lora_gated}
# Also round-tripped: its keys contain ".mlp.mlp." untiled, which the tiled model must keep.
ROUND_TRIP_BUILDERS = {**BUILDERS, "child_named_mlp": HoldsAnMLP}


@pytest.mark.parametrize("builder", BUILDERS.values(), ids=BUILDERS)
def test_wrapper_keeps_the_inner_keys(builder):
    mlp = builder(HIDDEN, INTER)
    assert list(TiledMLP(mlp).state_dict()) == list(mlp.state_dict())


@pytest.mark.parametrize("builder", BUILDERS.values(), ids=BUILDERS)
def test_model_keys_are_identical_after_tiling(builder):
    torch.manual_seed(0)
    untiled = Model(builder)
    keys = list(untiled.state_dict())
    tiled = tile_model(Model(builder))
    assert list(tiled.state_dict()) == keys
    assert all(".mlp.mlp." not in k for k in keys)


@pytest.mark.parametrize("builder", ROUND_TRIP_BUILDERS.values(), ids=ROUND_TRIP_BUILDERS)
def test_checkpoint_round_trip(builder, tmp_path):
    torch.manual_seed(0)
    untiled = Model(builder).double()
    torch.save(untiled.state_dict(), tmp_path / "untiled.pt")
    torch.manual_seed(1)  # different weights, overwritten by the load
    tiled = tile_model(Model(builder).double(), num_shards=3)
    result = tiled.load_state_dict(torch.load(tmp_path / "untiled.pt"), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    want = untiled.state_dict()
    got = tiled.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)

    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    torch.testing.assert_close(tiled(x), untiled(x), rtol=1e-10, atol=1e-12)

    # And back: train the tiled model one step, load its checkpoint into a fresh untiled model.
    with torch.no_grad():
        for p in tiled.parameters():
            p.add_(0.01)
    torch.manual_seed(2)
    back = Model(builder).double()
    result = back.load_state_dict(tiled.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(torch.equal(tiled.state_dict()[k], v) for k, v in back.state_dict().items())
    torch.testing.assert_close(tiled(x), back(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("builder", ROUND_TRIP_BUILDERS.values(), ids=ROUND_TRIP_BUILDERS)
def test_a_tiled_module_loads_its_own_state_dict_and_keeps_its_parameters(builder):
    mlp = builder(HIDDEN, INTER)
    tiled = TiledMLP(mlp)
    state = {k: torch.randn_like(v) for k, v in tiled.state_dict().items()}
    result = tiled.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(torch.equal(state[k], v) for k, v in mlp.state_dict().items())
    assert [id(p) for p in tiled.parameters()] == [id(p) for p in mlp.parameters()]
    assert tiled is mlp  # tiled in place: no wrapper level in any name
    assert [n for n, _ in tiled.named_parameters()] == [n for n, _ in mlp.named_parameters()]
