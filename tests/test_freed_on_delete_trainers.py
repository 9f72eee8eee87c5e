"""A model trained by transformers' ``Trainer`` or TRL's ``SFTTrainer``, tiled, is freed with the trainer by reference
counts alone, as the untiled one is (tests/test_freed_on_delete.py says why, and holds the collector off)."""
from __future__ import annotations

import weakref

import pytest
from test_label_smoothing import _trainer

from integration_tests.frameworks import need
from integration_tests.tiny_models import FAMILIES
from tiled_mlp import apply_tiled_mlp
from tiled_mlp.integrations import use_tiled_label_smoothing

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("llama_built_once")]


def _model_and_trainer_refs(model, trainer):
    return weakref.ref(model), weakref.ref(model.model.layers[0].mlp.up_proj.weight), weakref.ref(trainer)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_a_model_trained_with_the_trainers_label_smoothing_handed_over_is_freed(no_collector, tmp_path, tiled):
    need("transformers")
    model = FAMILIES["llama"].build()
    if tiled:
        apply_tiled_mlp(model, num_shards=2, loss=True, norms=True)
    trainer = _trainer(model, tmp_path, "run")
    if tiled:
        assert use_tiled_label_smoothing(trainer) == 0.1
    trainer.train()
    refs = _model_and_trainer_refs(model, trainer)
    del model, trainer
    assert [ref() for ref in refs] == [None, None, None], "a reference cycle keeps the model alive"


@pytest.mark.parametrize("tiled", ["untiled", "before", "after"])
def test_a_model_trained_by_trls_sft_trainer_is_freed(no_collector, tmp_path, tiled):
    """Tiled before the trainer is built (TRL's head wraps the tiled loss) or after. TRL's fused LM head makes a
    cycle of its own (the forward it writes on the instance closes over the model's bound forward): it is taken
    off by hand, in every case, so that what is left is the tiling's."""
    need("trl")
    from integration_tests.test_framework_trl import sft_trainer

    model = FAMILIES["llama"].build()
    if tiled == "before":
        apply_tiled_mlp(model, num_shards=2, loss=True, norms=True)
    trainer = sft_trainer(model, tmp_path, "run")
    if tiled == "after":
        apply_tiled_mlp(model, num_shards=2, loss=True, norms=True)
    trainer.train()
    vars(model).pop("forward")  # TRL's
    refs = _model_and_trainer_refs(model, trainer)
    del model, trainer
    assert [ref() for ref in refs] == [None, None, None], "a reference cycle keeps the model alive"
