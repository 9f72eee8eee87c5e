"""``apply_tiled_mlp`` / ``remove_tiled_mlp`` on a model: what is matched, what is kept unchanged
(state_dict keys, parameter identity, checkpoints), idempotence, and the config and flag entry points."""
from __future__ import annotations

import argparse
import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

from tiled_mlp import TiledMLP
from tiled_mlp.integrations import (
    add_tiled_mlp_args,
    apply_from_flags,
    apply_tiled_mlp,
    enable_tiled_mlp,
    from_config,
    from_pretrained,
    is_tiled,
    read_tiled_mlp_flags,
    remove_tiled_mlp,
)


class CustomMLP(nn.Module):
    """An unknown architecture with the gated layout."""

    def __init__(self, hidden=8, inner=12):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inner), nn.Linear(hidden, inner)
        self.down_proj = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))


class TwoInputMLP(CustomMLP):
    def forward(self, x, scale):
        return super().forward(x) * scale


class TanhFcMLP(nn.Module):
    """fc1/fc2: no structural rule matches it; only an include pattern can select it."""

    def __init__(self, hidden=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 20), nn.Linear(20, hidden)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"ffn": CustomMLP(), "extra": TanhFcMLP()}) for _ in range(2)])
        self.odd = TwoInputMLP()

    def forward(self, x):
        for block in self.blocks:
            x = x + block["ffn"](x) + block["extra"](x)
        return self.odd(x, 0.5)


class RoutedGatedBlock(nn.Module):
    """A gated block that also returns router logits, as MoE blocks do: not one tensor, so not tileable as a call."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x) -> tuple[torch.Tensor, torch.Tensor]:  # a string here (this module's future import)
        return self.down_proj(self.gate_proj(x) * self.up_proj(x)), x.sum(-1)


def test_a_block_returning_a_tuple_is_skipped_and_said_why():
    model = nn.Sequential(RoutedGatedBlock())
    report = apply_tiled_mlp(model)
    assert not report.patched and report.skipped[0][0] == "0"
    assert "forward returns a tuple" in report.skipped[0][1]


@pytest.mark.timeout(30)
def test_unknown_architecture_matched_by_structure_and_skips_reported():
    torch.manual_seed(0)
    model = Net().double()
    reference = copy.deepcopy(model)
    report = apply_tiled_mlp(model, num_shards=4)
    assert [b.name for b in report.patched] == ["blocks.0.ffn", "blocks.1.ffn"]
    assert [name for name, _ in report.skipped] == ["odd"]
    assert "more than one input" in report.skipped[0][1]
    assert "skipped odd" in str(report)
    x = torch.randn(2, 11, 8, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    model(x).square().sum().backward()
    reference(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    for (name, p), (_, q) in zip(model.state_dict(keep_vars=True).items(), reference.state_dict(keep_vars=True).items(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert report.paths() == {"blocks.0.ffn": "generic", "blocks.1.ffn": "generic"}  # relu: not a fast activation


@pytest.mark.timeout(30)
def test_include_selects_custom_blocks_and_exclude_wins():
    model = Net()
    report = apply_tiled_mlp(model, num_shards=2, include=["blocks.*.extra", "blocks.1.ffn"], exclude="blocks.0.*")
    assert [b.name for b in report.patched] == ["blocks.1.ffn", "blocks.1.extra"]
    assert [b.kind for b in report.patched] == ["gated", "named"]
    assert ("blocks.0.extra", "excluded by pattern") in report.skipped
    assert not isinstance(model.blocks[0]["ffn"], TiledMLP)
    with pytest.raises(TypeError, match="include/exclude take glob patterns"):
        apply_tiled_mlp(Net(), include=["blocks.*.extra", 1])


@pytest.mark.timeout(30)
def test_state_dict_keys_parameter_identity_twice_and_remove():
    pytest.importorskip("transformers")
    from integration_tests.tiny_models import tiny_model

    model = tiny_model("qwen3_moe", dtype=torch.float32)
    keys = list(model.state_dict())
    params = {k: id(p) for k, p in model.state_dict(keep_vars=True).items()}
    originals = {name: m for name, m in model.named_modules() if name in ("model.layers.0.mlp.experts", "model.layers.1.mlp")}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # made before tiling: must still hold the same tensors

    first = apply_tiled_mlp(model, num_shards=2)
    assert list(model.state_dict()) == keys
    assert {k: id(p) for k, p in model.state_dict(keep_vars=True).items()} == params
    assert {id(p) for p in model.parameters()} == {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert len(first.patched) == 2

    second = apply_tiled_mlp(model, num_shards=2)  # harmless: nothing new, nothing wrapped twice
    assert second.patched == [] and [b.name for b in second.already_tiled] == [b.name for b in first.patched]
    assert "  kept    model.layers.1.mlp (TiledQwen3MoeMLP): already tiled" in str(second).splitlines()
    assert sum(isinstance(m, TiledMLP) for m in model.modules()) == 2

    model.load_state_dict(copy.deepcopy(model.state_dict()))  # tiled loads its own checkpoint
    restored = remove_tiled_mlp(model)
    assert sorted(restored) == sorted(originals)
    assert not is_tiled(model)
    for name, module in model.named_modules():
        if name in originals:
            assert module is originals[name]
            assert "forward" not in module.__dict__  # the original forward, not a leftover patch
    assert list(model.state_dict()) == keys


@pytest.mark.timeout(60)
def test_save_pretrained_round_trip_and_config_flag(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from integration_tests.tiny_models import tiny_model

    model = tiny_model("llama", dtype=torch.float32)
    enable_tiled_mlp(model.config, num_shards=3)
    report = apply_tiled_mlp(model, num_shards=3)
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids).logits

    untiled = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")  # a plain load ignores the flag
    assert not is_tiled(untiled)
    torch.testing.assert_close(untiled(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)

    reloaded = from_pretrained(AutoModelForCausalLM, tmp_path / "ckpt")  # the saved flag asks for tiling
    assert is_tiled(reloaded) and reloaded.model.layers[0].mlp.tiling.num_shards == 3
    torch.testing.assert_close(reloaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    assert report.paths()["model.layers.0.mlp"] == "fast"

    config = copy.deepcopy(untiled.config)
    config.use_tiled_mlp = False
    assert not is_tiled(from_config(LlamaForCausalLM, config))
    built = from_config(AutoModelForCausalLM, config, use_tiled_mlp=True, tiled_mlp_num_shards=5)
    assert is_tiled(built) and built.model.layers[1].mlp.tiling.num_shards == 5

    # Values as a JSON or YAML config spells them: "false" must not tile, "4" is a count, 2.7 is refused.
    config.use_tiled_mlp, config.tiled_mlp_num_shards = "false", "4"
    assert not is_tiled(from_config(LlamaForCausalLM, copy.deepcopy(config)))
    config.use_tiled_mlp = "True"
    built = from_config(LlamaForCausalLM, copy.deepcopy(config))
    assert is_tiled(built) and built.model.layers[0].mlp.tiling.num_shards == 4
    assert not is_tiled(from_config(LlamaForCausalLM, copy.deepcopy(untiled.config), use_tiled_mlp="0"))
    with pytest.raises(ValueError, match="tiled_mlp_num_shards"):
        from_config(LlamaForCausalLM, copy.deepcopy(untiled.config), use_tiled_mlp="yes", tiled_mlp_num_shards=2.7)


@pytest.mark.timeout(30)
def test_training_script_flags():
    parser = add_tiled_mlp_args(argparse.ArgumentParser())
    assert read_tiled_mlp_flags(parser.parse_args([])).use_tiled_mlp is False
    args = parser.parse_args(["--use_tiled_mlp", "--tiled_mlp_num_shards", "4"])
    assert (args.use_tiled_mlp, args.tiled_mlp_num_shards) == (True, 4)
    assert parser.parse_args(["--tiled_mlp_num_shards", "auto"]).tiled_mlp_num_shards == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--tiled_mlp_num_shards", "0"])
    flags = read_tiled_mlp_flags({"use_tiled_mlp": True, "tiled_mlp_num_shards": "3"})
    assert (flags.use_tiled_mlp, flags.num_shards) == (True, 3)
    with pytest.raises(ValueError):
        read_tiled_mlp_flags({"tiled_mlp_num_shards": "many"})
    model = Net()
    assert apply_from_flags(model, {"use_tiled_mlp": False}) is None and not is_tiled(model)
    assert len(apply_from_flags(model, args).report.patched) == 2
    assert model.blocks[0]["ffn"].tiling.num_shards == 4


@pytest.mark.timeout(30)
def test_fast_path_request_is_checked_before_any_change():
    model = Net()
    with pytest.raises(ValueError, match="blocks.0.ffn"):
        apply_tiled_mlp(model, path="fast")
    assert not is_tiled(model)


@pytest.mark.timeout(60)
def test_importing_tiled_mlp_imports_no_optional_library():
    code = ("import sys, tiled_mlp, tiled_mlp.integrations, tiled_mlp.integrations.hf; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'peft', 'accelerate'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True)
    assert out.stdout.strip() == "[]"
