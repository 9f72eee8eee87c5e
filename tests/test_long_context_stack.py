"""``apply_long_context``: the tiled MLP, the tiled loss, checkpointing and checkpoint offload (and SP,
proven across processes in ``integration_tests/test_sequence_parallel.py``) in one call, exact against
the plain model in float64, undone in one call, and refused before any change where it cannot apply.
The training-script flags that drive it."""
from __future__ import annotations

import argparse
import copy

import pytest
import torch
from reference import param_grads

pytest.importorskip("transformers")

from integration_tests.comparison import float_kept_float64  # noqa: E402
from integration_tests.tiny_models import tiny_model, token_batch  # noqa: E402
from tiled_mlp.core import TiledMLP  # noqa: E402
from tiled_mlp.integrations import (  # noqa: E402
    add_tiled_mlp_args,
    apply_from_flags,
    apply_long_context,
    is_tiled,
    is_tiled_loss,
    read_tiled_mlp_flags,
)
from tiled_mlp.integrations.offload import checkpointed_layers  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _plain_loss(model, ids, labels):
    """The model's own loss path in float64 (``ForCausalLMLoss``'s ``.float()`` kept float64)."""
    with float_kept_float64():
        return model(input_ids=ids, labels=labels).loss


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_stack_is_exact_and_comes_off_in_one_call(family):
    reference = tiny_model(family)
    model = copy.deepcopy(reference)
    names = [name for name, _ in model.named_parameters()]
    stack = apply_long_context(model, num_shards=3, loss_num_shards=2)
    assert is_tiled(model) and is_tiled_loss(model) and stack.checkpointing_turned_on
    assert {block.kind for block in stack.report.patched} == {"gated", "norm"}  # the norms by default
    assert len(checkpointed_layers(model)) == model.config.num_hidden_layers
    model.train()
    reference.train()
    ids, labels = token_batch(seq=13, masked=5)
    want = _plain_loss(reference, ids, labels)
    want.backward()
    loss = model(input_ids=ids, labels=labels).loss
    hidden = model.config.hidden_size
    assert stack.offload.host_bytes.current == (model.config.num_hidden_layers - 1) * ids.numel() * hidden * 8
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-12)
    for name, g in param_grads(reference).items():
        torch.testing.assert_close(param_grads(model)[name], g, rtol=0, atol=1e-12, msg=name)
    assert [name for name, _ in model.named_parameters()] == names

    stack.remove()
    assert not is_tiled(model) and not is_tiled_loss(model) and not checkpointed_layers(model)
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)
    model.zero_grad()
    reference.zero_grad()
    again = model(input_ids=ids, labels=labels)
    assert again.logits is not None  # the model's own forward again
    torch.testing.assert_close(_plain_loss(model, ids, labels), _plain_loss(reference, ids, labels), rtol=0, atol=1e-12)


def test_checkpointing_already_on_is_kept_on_after_remove():
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    stack = apply_long_context(model)
    assert not stack.checkpointing_turned_on
    stack.remove()
    assert len(checkpointed_layers(model)) == model.config.num_hidden_layers


def test_each_piece_can_be_left_out():
    model = tiny_model("llama")
    stack = apply_long_context(model, tiled_mlp=False, tiled_norms=False, checkpoint_offload=False)
    assert is_tiled_loss(model) and not is_tiled(model) and stack.offload is None and not checkpointed_layers(model)
    stack.remove()
    assert not is_tiled_loss(model)


def test_the_norms_with_or_without_the_mlps():
    """``tiled_norms=True`` tiles the five RMSNorms of the tiny model beside the MLPs, or alone; exact in
    float64 with the rest of the stack; off in one call."""
    reference = tiny_model("llama")
    ids, labels = token_batch(1, seq=13, masked=5)
    reference.train()
    want = _plain_loss(reference, ids, labels)
    want.backward()
    for tiled_mlp, blocks in ((True, {"norm": 5, "gated": 2}), (False, {"norm": 5})):
        model = copy.deepcopy(reference)
        model.zero_grad()
        stack = apply_long_context(model, tiled_mlp=tiled_mlp, tiled_norms=True, num_shards=3, loss_num_shards=2)
        kinds = [block.kind for block in stack.report.patched]
        assert {kind: kinds.count(kind) for kind in set(kinds)} == blocks
        model.train()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.testing.assert_close(loss, want, rtol=0, atol=1e-12)
        for name, g in param_grads(reference).items():
            torch.testing.assert_close(param_grads(model)[name], g, rtol=0, atol=1e-12, msg=name)
        stack.remove()
        assert not is_tiled(model) and not is_tiled_loss(model)


def test_tiling_options_with_nothing_to_tile_are_refused_before_any_change():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"\['strategy'\] are apply_tiled_mlp's options"):
        apply_long_context(model, tiled_mlp=False, tiled_norms=False, strategy="single")
    with pytest.raises(ValueError, match="include selects MLP blocks"):
        apply_long_context(model, tiled_mlp=False, tiled_norms=True, include=["model.layers.0.mlp"])
    assert not is_tiled(model) and not is_tiled_loss(model) and not checkpointed_layers(model)


def test_sequence_parallel_without_the_tiled_loss_is_refused_before_any_change():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs tiled_loss=True"):
        apply_long_context(model, tiled_loss=False, sequence_parallel=2)
    assert not is_tiled(model) and not checkpointed_layers(model)


def test_a_failing_step_undoes_the_steps_before_it():
    """SP without a process group fails last: the tiling, the loss, checkpointing and the offload are undone."""
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="initialize torch.distributed"):
        apply_long_context(model, sequence_parallel=2)
    assert not is_tiled(model) and not is_tiled_loss(model) and not checkpointed_layers(model)
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)


def test_a_step_failing_after_the_others_are_on_undoes_them(monkeypatch):
    """The SP step fails after the tiling, the loss, checkpointing and the offload are on: all are taken off."""
    from tiled_mlp.integrations import stack as stack_module

    def fails(*args, **kwargs):
        raise RuntimeError("the SP step failed")

    monkeypatch.setattr(stack_module, "check_sequence_parallel", lambda model, size: None)
    monkeypatch.setattr(stack_module, "apply_sequence_parallel", fails)
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="the SP step failed"):
        apply_long_context(model, sequence_parallel=2)
    assert not is_tiled(model) and not is_tiled_loss(model) and not checkpointed_layers(model)
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)


def test_flags_for_each_piece():
    parser = add_tiled_mlp_args(argparse.ArgumentParser())
    args = parser.parse_args(["--use_tiled_mlp", "--use_tiled_loss", "true", "--use_checkpoint_offload",
                              "--ulysses_sp_size", "1", "--use_tiled_norms"])
    flags = read_tiled_mlp_flags(args)
    assert (flags.use_tiled_mlp, flags.use_tiled_loss, flags.use_checkpoint_offload, flags.ulysses_sp_size,
            flags.use_tiled_norms) == (True, True, True, 1, True)
    assert not parser.parse_args([]).use_tiled_norms
    assert read_tiled_mlp_flags({"use_tiled_norms": "yes"}).asks_for_anything
    with pytest.raises(ValueError, match="use_tiled_norms"):
        read_tiled_mlp_flags({"use_tiled_norms": "maybe"})
    assert read_tiled_mlp_flags({"use_checkpoint_offload": "off", "ulysses_sp_size": "4"}).ulysses_sp_size == 4
    for bad in ("0", "two", "1.5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--ulysses_sp_size", bad])
    with pytest.raises(ValueError, match="ulysses_sp_size"):
        read_tiled_mlp_flags({"ulysses_sp_size": 0})
    with pytest.raises(ValueError, match="use_checkpoint_offload"):
        read_tiled_mlp_flags({"use_checkpoint_offload": "maybe"})

    model = tiny_model("llama")
    stack = apply_from_flags(model, args)
    assert is_tiled(model) and is_tiled_loss(model) and stack.offload is not None
    assert isinstance(model.model.norm, TiledMLP)
    stack.remove()
    assert apply_from_flags(model, {"use_tiled_mlp": False}) is None


def test_sequence_parallel_loss_needs_an_initialized_group():
    from tiled_mlp.core import tiled_cross_entropy

    head = torch.nn.Linear(4, 8, dtype=torch.float64)
    hidden = torch.randn(1, 6, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="not initialized"):
        tiled_cross_entropy(hidden, head, torch.zeros(1, 6, dtype=torch.long), sequence_group=object())


def test_a_model_that_already_has_a_piece_is_refused_and_kept():
    """remove() could not tell the caller's own tiling from the call's: refused, the caller's tiling kept."""
    from tiled_mlp.integrations import apply_tiled_mlp

    model = tiny_model("llama")
    apply_tiled_mlp(model, num_shards=4, loss=True)
    with pytest.raises(ValueError, match="already has tiled MLPs or the tiled loss"):
        apply_long_context(model)
    assert is_tiled(model) and is_tiled_loss(model) and not checkpointed_layers(model)


def test_deep_copy_keeps_the_model_and_its_forward_together():
    """The copied model's forward is the copied forward (bound to the copy, not to the original)."""
    model = tiny_model("llama")
    apply_long_context(model, checkpoint_offload=False)
    clone = copy.deepcopy(model)
    assert vars(clone)["forward"].model is clone and vars(clone)["forward"] is not vars(model)["forward"]
    forward = copy.deepcopy(model.forward)
    assert vars(forward.model)["forward"] is forward
