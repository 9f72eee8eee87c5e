"""A model tiled through the training frameworks' entry points (driven without the frameworks, as
tests/test_framework_entry_points.py and tests/test_ms_swift_plugin.py do) is freed by its last reference while
the entry point's own object lives on: Axolotl keeps its plugins for the whole process, a LLaMA-Factory callback
may serve several runs. tests/test_freed_on_delete.py says why, and holds the collector off."""
from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
from test_framework_entry_points import RELEASE, stub_axolotl  # noqa: F401 - the fixture

from integration_tests.frameworks import need
from integration_tests.tiny_models import FAMILIES, token_batch
from tiled_mlp.integrations.framework_settings import CheckedFramework

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("llama_built_once")]


def _lm_train_step(model) -> None:
    ids, labels = token_batch()
    model(input_ids=ids, labels=labels).loss.backward()


def _model_refs(model):
    return weakref.ref(model), weakref.ref(model.model.layers[0].mlp.up_proj.weight)


def _tile_by(entry_point: str, model, monkeypatch, stub) -> object:
    """Tiles ``model`` as the entry point does; returns the entry point's object that outlives the model."""
    if entry_point == "axolotl":
        plugin = stub.TiledMLPPlugin()
        plugin.pre_model_load({})
        plugin.post_model_load({}, model)
        assert plugin.report.tiled_loss
        return plugin
    if entry_point == "llamafactory":
        from tiled_mlp.integrations import llamafactory

        monkeypatch.setattr(llamafactory, "LLAMAFACTORY", CheckedFramework("LLaMA-Factory", "torch", (RELEASE,)))
        callback = llamafactory.TiledMLPCallback()
        callback.on_init_end(None, None, None, model=model)
        assert callback.report.tiled_loss
        return callback
    from tiled_mlp.integrations import ms_swift

    args = SimpleNamespace(model_kwargs={"use_tiled_mlp": True, "use_tiled_norms": True})
    handle = ms_swift.tile_prepared_model(model, args, "SwiftSft", ms_swift.CHECKED_VERSIONS[-1], log=lambda _: None)
    assert handle is not None and handle.report.patched
    return ms_swift  # what lives on: the module (the wrapped prepare_model drops the handle)


@pytest.mark.parametrize("entry_point", ["axolotl", "llamafactory", "ms_swift"])
def test_a_model_tiled_by_a_frameworks_entry_point_is_freed_while_the_entry_point_lives(
        no_collector, stub_axolotl, monkeypatch, entry_point):  # noqa: F811
    need("transformers")
    model = FAMILIES["llama"].build()
    kept = _tile_by(entry_point, model, monkeypatch, stub_axolotl)
    _lm_train_step(model)
    refs = _model_refs(model)
    del model
    assert [ref() for ref in refs] == [None, None], f"{entry_point}'s entry point keeps the model alive"
    report = getattr(kept, "report", None)
    if report is not None:  # what it says stays readable
        assert "tiled 2 MLP block(s)" in str(report)
        with pytest.raises(ReferenceError, match="was freed with its model"):
            report.paths()
