"""Checkpoint offload (``tiled_mlp.core.checkpoint_offload``, ``apply_checkpoint_offload``): the input of each
checkpointed layer but the last waits for its backward in host memory; gradients exact, the device copy
freed, nothing else moved."""
from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tiled_mlp.core.checkpoint_offload import CheckpointOffload
from tiled_mlp.integrations.offload import apply_checkpoint_offload

pytestmark = pytest.mark.timeout(60)
HIDDEN, TOKENS, LAYERS = 8, 5, 4


class TanhBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


def _stack(seed=0, wrapped=True):
    torch.manual_seed(seed)
    blocks = [TanhBlock() for _ in range(LAYERS)]
    return nn.Sequential(*(checkpoint_wrapper(b) if wrapped else b for b in blocks))


def _input():
    return torch.randn(TOKENS, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)


def test_inputs_but_the_last_move_to_host_and_gradients_are_exact():
    reference, model = _stack(), _stack()
    offload = apply_checkpoint_offload(model)
    x_ref, x = _input(), _input()
    reference(x_ref).sum().backward()
    out = model(x)
    one_input = TOKENS * HIDDEN * 8
    assert offload.host_bytes.current == (LAYERS - 1) * one_input  # the last layer's input stays on the device
    out.sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert offload.host_bytes.peak == (LAYERS - 1) * one_input
    del out
    gc.collect()
    assert offload.host_bytes.current == 0  # freed with the graph


def test_the_device_copy_of_an_offloaded_input_is_freed_before_backward():
    """What offloading is for: between forward and backward no device tensor holds layer 1's input."""
    kept = {}

    class Recording(nn.Sequential):
        def forward(self, x):
            for index, layer in enumerate(self):
                kept[index] = weakref.ref(x)
                x = layer(x)
            return x

    for offloaded in (False, True):
        model = Recording(*_stack())
        offload = apply_checkpoint_offload(model) if offloaded else None
        out = model(_input())
        gc.collect()
        alive = {i for i, ref in kept.items() if ref() is not None}
        # Input 0 is the caller's tensor (alive either way); 1..LAYERS-2 offloaded; the last one kept.
        assert alive == ({0, LAYERS - 1} if offloaded else set(range(LAYERS))), alive
        out.sum().backward()
        if offload is not None:
            offload.remove()


def test_hugging_face_checkpointing_both_kinds_with_tiled_mlp_and_loss():
    pytest.importorskip("transformers")
    from integration_tests.tiny_models import VOCAB, tiny_model
    from tiled_mlp import apply_tiled_mlp

    for reentrant in (False, True):
        reference = tiny_model("llama")
        model = copy.deepcopy(reference)
        for m in (reference, model):
            m.train()
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            apply_tiled_mlp(m, num_shards=3, loss=True)  # the same step; only the offload differs
        offload = apply_checkpoint_offload(model)
        ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
        reference(input_ids=ids, labels=ids).loss.backward()
        loss = model(input_ids=ids, labels=ids).loss
        layers = model.config.num_hidden_layers
        assert offload.host_bytes.current == (layers - 1) * 2 * 13 * model.config.hidden_size * 8
        loss.backward()
        for (name, a), b in zip(reference.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(b.grad, a.grad), name  # values copied out and back, never changed


def test_no_graph_nothing_moves_and_remove_undoes_it():
    model = _stack()
    offload = apply_checkpoint_offload(model)
    with torch.no_grad():
        model(_input())
    assert offload.host_bytes.peak == 0
    offload.remove()
    out = model(_input())
    assert offload.host_bytes.peak == 0 and all(not layer._forward_pre_hooks for layer in model)
    out.sum().backward()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_model_offloads_its_own_layers(how):
    """The offload holds its layers weakly (tests/test_freed_on_delete.py): a copy of the model still carries an
    offload of the copy's layers, which offloads as the original does."""
    model = _stack()
    offload = apply_checkpoint_offload(model)
    clone = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    copied = next(iter(clone[0]._forward_pre_hooks.values())).__self__
    assert copied is not offload and [id(layer) for layer in copied.layers] == [id(layer) for layer in clone]
    clone(_input()).sum().backward()
    model(_input()).sum().backward()
    assert copied.host_bytes.peak == offload.host_bytes.peak == (LAYERS - 1) * TOKENS * HIDDEN * 8


def test_refused_without_checkpointed_layers():
    with pytest.raises(ValueError, match="no checkpointed layer"):
        apply_checkpoint_offload(_stack(wrapped=False))


def test_a_layer_called_twice_offloads_each_call():
    """A layer shared by two places in the model (called twice per step) keeps both calls' inputs apart."""
    block = checkpoint_wrapper(TanhBlock())
    reference = copy.deepcopy(block)
    offload = CheckpointOffload([block, checkpoint_wrapper(TanhBlock())])
    x, x_ref = _input(), _input()
    block(block(x)).sum().backward()
    reference(reference(x_ref)).sum().backward()
    assert offload.host_bytes.peak == 2 * TOKENS * HIDDEN * 8
    assert torch.equal(x.grad, x_ref.grad)


def test_bench_offload_command_runs_and_refuses_one_layer(capsys):
    pytest.importorskip("transformers")
    from tiled_mlp.cli.main import main

    assert main(["bench-offload", "--layers", "2", "--seq", "64", "--hidden", "32", "--intermediate", "64",
                 "--heads", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "| with offload |" in out and f"host memory held: {64 * 32 * 4:,} bytes" in out  # layer 1's input
    with pytest.raises(SystemExit):
        main(["bench-offload", "--layers", "1"])
