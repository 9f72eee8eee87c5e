"""The ms-swift plugin's decisions, without ms-swift: where the flags come from, what it refuses before any work,
and what it tiles. ``integration_tests/test_framework_ms_swift.py`` runs it under the real ``swift sft``."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from integration_tests.tiny_models import tiny_model  # noqa: E402
from tiled_mlp import TiledMLP  # noqa: E402
from tiled_mlp.integrations import ms_swift  # noqa: E402

CHECKED = ms_swift.CHECKED_VERSIONS[-1]


def _tile_by_plugin(model_kwargs=None, environ=None, version=CHECKED, pipeline="SwiftSft", monkeypatch=None):
    for name in ms_swift.FLAGS + ms_swift.UNCHECKED_FLAGS:
        monkeypatch.delenv(name.upper(), raising=False)
    for key, value in (environ or {}).items():
        monkeypatch.setenv(key, value)
    model = tiny_model("llama")
    handle = ms_swift.tile_prepared_model(model, SimpleNamespace(model_kwargs=model_kwargs or {}), pipeline, version,
                                          log=lambda text: None)
    return model, handle


def _tiled_count(model):
    return sum(isinstance(m, TiledMLP) for m in model.modules())


def test_model_kwargs_tile_the_mlps_and_norms(monkeypatch):
    model, handle = _tile_by_plugin({"use_tiled_mlp": True, "tiled_mlp_num_shards": 4, "use_tiled_norms": True},
                          monkeypatch=monkeypatch)
    assert "tiled 2 MLP block(s) and 5 norm(s)" in str(handle.report)
    assert _tiled_count(model) == 7
    assert {b.tiling.num_shards for b in model.modules() if isinstance(b, TiledMLP)} == {4}


def test_environment_as_ms_swift_exports_model_kwargs(monkeypatch):
    """ms-swift writes ``--model_kwargs`` into the environment upper-cased, values through ``str`` ("True")."""
    model, handle = _tile_by_plugin(environ={"USE_TILED_MLP": "True", "TILED_MLP_NUM_SHARDS": "3"}, monkeypatch=monkeypatch)
    assert "tiled 2 MLP block(s)" in str(handle.report) and "norm" not in str(handle.report)
    assert {b.tiling.num_shards for b in model.modules() if isinstance(b, TiledMLP)} == {3}


def test_model_kwargs_win_over_the_environment(monkeypatch):
    model, handle = _tile_by_plugin({"USE_TILED_MLP": "false"}, environ={"USE_TILED_MLP": "true"}, monkeypatch=monkeypatch)
    assert handle is None and _tiled_count(model) == 0


def test_nothing_asked_is_a_pass_through_on_any_version(monkeypatch):
    model, handle = _tile_by_plugin({"use_tiled_mlp": False}, version="0.0.1", pipeline="SwiftRLHF", monkeypatch=monkeypatch)
    assert handle is None and _tiled_count(model) == 0


@pytest.mark.parametrize(("kwargs", "version", "pipeline", "match"), [
    ({"use_tiled_mlp": True}, "4.5.0", "SwiftSft", r"checked on ms-swift 4\.6\.0, not 4\.5\.0: install ms-swift==4\.6\.0"),
    ({"use_tiled_norms": True}, CHECKED, "SwiftRLHF", r"checked with `swift sft` \(SwiftSft\), not SwiftRLHF"),
    ({"use_tiled_mlp": True, "use_tiled_loss": True}, CHECKED, "SwiftSft", r"does not apply use_tiled_loss"),
    ({"ulysses_sp_size": 2}, CHECKED, "SwiftSft", r"does not apply ulysses_sp_size.*--sequence_parallel_size"),
    ({"use_checkpoint_offload": "true"}, CHECKED, "SwiftSft", r"does not apply use_checkpoint_offload"),
])
def test_refused_before_any_work(kwargs, version, pipeline, match, monkeypatch):
    for name in ms_swift.FLAGS + ms_swift.UNCHECKED_FLAGS:
        monkeypatch.delenv(name.upper(), raising=False)
    model = tiny_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=match):
        ms_swift.tile_prepared_model(model, SimpleNamespace(model_kwargs=kwargs), pipeline, version)
    assert _tiled_count(model) == 0
    assert list(before) == [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"use_tiled_mlp": "maybe"}, "use_tiled_mlp must be a bool"),
    ({"use_tiled_mlp": True, "tiled_mlp_num_shards": "2.7"}, "tiled_mlp_num_shards"),
])
def test_bad_values_name_the_flag(kwargs, match, monkeypatch):
    with pytest.raises(ValueError, match=match):
        _tile_by_plugin(kwargs, monkeypatch=monkeypatch)


def test_plugin_file_sits_in_a_folder_of_its_own():
    """ms-swift puts a plugin's folder first on ``sys.path``: nothing there may shadow another module."""
    path = Path(ms_swift.plugin_path())
    assert path.is_file() and path.suffix == ".py"
    assert sorted(p.name for p in path.parent.glob("*.py")) == ["__init__.py", path.name]
    assert "install()" in path.read_text()
