"""A compiled tiled model saves what a compiled untiled one saves: after a compiled training step, its
``state_dict`` has the untiled model's keys (``_orig_mod.`` prefixed as torch.compile's wrapper names them),
loads into a fresh compiled untiled model with every key matched, and ``save_pretrained`` writes a checkpoint
that transformers loads back as a plain model with the trained tensors."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from integration_tests.tiny_models import VOCAB, tiny_model  # noqa: E402
from tiled_mlp import apply_tiled_mlp  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("fresh_dynamo")]


def _trained_compiled_tiled():
    untiled = tiny_model("llama")
    tiled = copy.deepcopy(untiled)
    apply_tiled_mlp(tiled, num_shards=2, loss=True, norms=True)
    compiled = torch.compile(tiled, backend="aot_eager")
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    compiled(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(tiled.parameters(), lr=0.1).step()
    assert any(not torch.equal(a, b) for a, b in zip(untiled.parameters(), tiled.parameters(), strict=True))
    return untiled, tiled, compiled


def test_a_compiled_tiled_state_dict_loads_into_a_compiled_untiled_model(tmp_path):
    untiled, _, compiled = _trained_compiled_tiled()
    saved = compiled.state_dict()
    assert list(saved) == list(torch.compile(untiled, backend="aot_eager").state_dict())
    torch.save(saved, tmp_path / "model.pt")
    fresh = torch.compile(tiny_model("llama"), backend="aot_eager")
    result = fresh.load_state_dict(torch.load(tmp_path / "model.pt"))
    assert not result.missing_keys and not result.unexpected_keys
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def _saved_names(directory) -> set:
    names = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as file:
            names.update(file.keys())
    return names


def test_save_pretrained_of_a_compiled_tiled_model_loads_back_as_a_plain_model(tmp_path):
    untiled, tiled, _ = _trained_compiled_tiled()
    tiled.save_pretrained(tmp_path / "tiled")
    untiled.save_pretrained(tmp_path / "untiled")
    # The files themselves: transformers' loading would drop an extra name with only a note.
    assert _saved_names(tmp_path / "tiled") == _saved_names(tmp_path / "untiled") != set()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tiled", dtype=torch.float64)
    assert type(loaded) is type(untiled)
    want = tiled.state_dict()
    assert list(loaded.state_dict()) == list(untiled.state_dict())
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, want[name]), name
