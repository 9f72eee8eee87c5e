"""``LongContextStack.remove`` takes off exactly what ``apply_long_context`` put on: where it turned Hugging
Face's checkpointing on, transformers also hooked the input embeddings (``make_inputs_require_grads``) and
set attributes on the model and its layers; remove takes those off, and leaves the user's own."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from integration_tests.tiny_models import VOCAB, tiny_model  # noqa: E402
from tiled_mlp.integrations import apply_long_context  # noqa: E402


def _hooks_and_attributes(model):
    """Every forward hook and instance attribute (but the module tables), by module name."""
    return {name: (list(module._forward_hooks.values()),
                   {k: v for k, v in vars(module).items()
                    if k not in ("_parameters", "_buffers", "_modules") and not k.endswith("hooks")})
            for name, module in model.named_modules()}


@pytest.mark.timeout(60)
def test_remove_takes_off_the_input_gradient_hook_checkpointing_added():
    model = tiny_model("llama")
    before = _hooks_and_attributes(model)
    stack = apply_long_context(model, num_shards=2)
    assert stack.checkpointing_turned_on is not None
    assert model.get_input_embeddings()._forward_hooks  # transformers' make_inputs_require_grads
    stack.remove()
    assert _hooks_and_attributes(model) == before
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    assert not model.get_input_embeddings()(torch.randint(0, VOCAB, (1, 7))).requires_grad  # no hook forces it


@pytest.mark.timeout(60)
def test_remove_keeps_the_users_own_input_gradient_hook():
    model = tiny_model("llama")
    model.enable_input_require_grads()  # the user's (PEFT's way), before the stack
    users = list(model._require_grads_hooks)
    embeddings = model.get_input_embeddings()
    before = _hooks_and_attributes(model)
    stack = apply_long_context(model, num_shards=2)
    assert len(embeddings._forward_hooks) == 2
    stack.remove()
    assert _hooks_and_attributes(model) == before
    assert model._require_grads_hooks == users and len(embeddings._forward_hooks) == 1
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    assert embeddings(torch.randint(0, VOCAB, (1, 7))).requires_grad  # the user's hook still works
