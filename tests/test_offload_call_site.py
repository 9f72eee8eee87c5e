"""Checkpoint offload where HF's checkpointing layer runs the checkpoint around its own module hooks
(transformers 5.6, ``__call__``): the offload hooks a call site of the layer's checkpoint function. Forced
here on whatever transformers is installed (5.25 calls the same function from ``forward``), so both sets
run it."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from integration_tests.tiny_models import VOCAB, tiny_model  # noqa: E402
from tiled_mlp.integrations.offload import apply_checkpoint_offload  # noqa: E402
from tiled_mlp.integrations.seams import transformers_internals  # noqa: E402


def test_the_call_site_offload_holds_each_input_but_the_last_and_changes_no_gradient(monkeypatch):
    monkeypatch.setattr(transformers_internals, "checkpoint_wraps_module_hooks", lambda: True)
    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    for m in (reference, model):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = list(model.model.layers)
    functions = [layer._gradient_checkpointing_func for layer in layers]
    offload = apply_checkpoint_offload(model)
    assert [type(site).__name__ for site in offload.layers] == ["_CheckpointCall"] * len(layers)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    reference(input_ids=ids, labels=ids).loss.backward()
    loss = model(input_ids=ids, labels=ids).loss
    assert offload.host_bytes.current == (len(layers) - 1) * 2 * 13 * model.config.hidden_size * 8
    loss.backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(b.grad, a.grad), name
    offload.remove()
    assert [layer._gradient_checkpointing_func for layer in layers] == functions
