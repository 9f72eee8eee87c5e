"""Refusals of the tiled loss on a Hugging Face causal LM (``causal_lm_loss.py``) that no other test reaches: its
forward called through a shallow copy after the model it was installed on was deleted, a decoder replaced after
installing (the hook that hands the loss its hidden states is on the old one), and a forward of the instance's own
under TRL's fused head or accelerate's device hook, or TRL's head over the class forward where the tiled loss is
checked without the report's hand-over (the planner, Ulysses SP)."""
from __future__ import annotations

import copy
import functools
import gc
import sys

import pytest

pytest.importorskip("transformers")

from integration_tests.frameworks import need  # noqa: E402
from integration_tests.tiny_models import tiny_model, token_batch  # noqa: E402
from tiled_mlp import apply_tiled_loss  # noqa: E402
from tiled_mlp.integrations import is_tiled_loss  # noqa: E402
from tiled_mlp.integrations.causal_lm_loss import check_tiled_loss  # noqa: E402


def test_the_forward_of_a_deleted_model_called_through_a_shallow_copy_is_refused():
    model = tiny_model("llama")
    apply_tiled_loss(model)
    forward = copy.copy(model).forward  # copy.copy shares the instance's forward, the tiled loss's
    del model
    gc.collect()
    ids, labels = token_batch()
    with pytest.raises(RuntimeError, match="the model this forward was installed on was deleted, and the forward "
                                           "was called without going through a model"):
        forward(input_ids=ids, labels=labels)


def test_a_decoder_replaced_after_installing_is_refused_at_the_call():
    from transformers import LlamaModel

    model = tiny_model("llama")
    apply_tiled_loss(model)
    model.model = LlamaModel(model.config).double()
    ids, labels = token_batch()
    with pytest.raises(RuntimeError, match="forward did not call the decoder the tiled loss was installed on"):
        model(input_ids=ids, labels=labels)
    assert all(p.grad is None for p in model.parameters())


def _own_forward(model):
    """A forward set on the instance: the class's, through ``functools.partial`` (not the class's bound method)."""
    model.forward = functools.partial(type(model).forward, model)
    return model


def test_trls_head_over_a_forward_of_the_instances_own_is_refused():
    trl_utils = sys.modules[need("trl").trainer.utils.__name__]
    model = _own_forward(tiny_model("llama"))
    trl_utils.add_fused_lm_head(model)
    with pytest.raises(TypeError, match=r"tiled loss cannot be put on LlamaForCausalLM: TRL .*'s fused LM head "
                                        r"\(trl.trainer.utils.add_fused_lm_head\) is on its forward, over a forward that "
                                        r"is not its class's \(functools.partial of"):
        apply_tiled_loss(model)
    assert not is_tiled_loss(model)


def test_trls_head_over_the_class_forward_is_refused_where_the_loss_is_checked_alone():
    trl_utils = sys.modules[need("trl").trainer.utils.__name__]
    model = tiny_model("llama")
    trl_utils.add_fused_lm_head(model)
    with pytest.raises(TypeError, match="is on its forward: TRL's trainers compute the loss through it, in tiles"):
        check_tiled_loss(model)


def test_accelerates_device_hook_over_a_forward_of_the_instances_own_is_refused():
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = add_hook_to_module(_own_forward(tiny_model("llama")), ModelHook())
    with pytest.raises(TypeError, match=r"accelerate's device hook on it \(.*ModelHook.*: dispatch_model, cpu_offload\) "
                                        r"wraps a forward that is not its class's \(functools.partial of"):
        apply_tiled_loss(model)
    assert not is_tiled_loss(model)
