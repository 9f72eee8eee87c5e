"""A tiled transformers model in training setups: PEFT LoRA, gradient checkpointing, Trainer,
torch.compile. Each is compared with the same setup untiled."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from integration_tests.tiny_models import TokenRows, grads_by_key, tiny_model, token_ids  # noqa: E402
from tiled_mlp import TiledMLP  # noqa: E402
from tiled_mlp.integrations import apply_tiled_mlp  # noqa: E402

SHARDS = 3


def _assert_grads_equal(reference, tiled, rtol, atol, require=None):
    want, got = grads_by_key(reference), grads_by_key(tiled)
    assert want.keys() == got.keys()
    for key, want_grad in want.items():
        assert (want_grad is None) == (got[key] is None), key
        if want_grad is not None:
            torch.testing.assert_close(got[key], want_grad, rtol=rtol, atol=atol, msg=key)
    if require is not None:  # the gradients that must exist (and be non-zero) for the test to mean anything
        present = {k for k, g in want.items() if g is not None}
        assert present == {k for k in want if require(k)}, sorted(present ^ {k for k in want if require(k)})
        assert all(want[k].abs().max() > 0 for k in present)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ["tile_then_lora", "lora_then_tile"])
def test_peft_lora_only_adapter_grads_and_equal_to_untiled(order):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=["gate_proj", "up_proj", "down_proj"])
    reference = peft.get_peft_model(tiny_model("llama"), copy.deepcopy(config))
    if order == "tile_then_lora":
        base = tiny_model("llama")
        apply_tiled_mlp(base, num_shards=SHARDS)
        tiled = peft.get_peft_model(base, copy.deepcopy(config))
        tiled.load_state_dict(reference.state_dict())  # the same adapter weights (keys match, tiled or not)
    else:
        tiled = copy.deepcopy(reference)
        apply_tiled_mlp(tiled, num_shards=SHARDS)
    blocks = [m for m in tiled.modules() if isinstance(m, TiledMLP)]
    assert len(blocks) == 2
    ids = token_ids()
    reference(input_ids=ids, labels=ids).loss.backward()
    tiled(input_ids=ids, labels=ids).loss.backward()
    _assert_grads_equal(reference, tiled, rtol=1e-9, atol=1e-12,
                        require=lambda key: "lora_" in key and ".mlp." in key)
    assert {b.tiling.last_path for b in blocks} == {"generic"}  # LoRA projections rule out the fast kernel


def _count_inner_calls(model):
    """Count calls of each tiled block's own forward (one per shard) and of its tiled forward (one per
    block call)."""
    counts = {"tiled": 0, "inner": 0}
    for block in (m for m in model.modules() if isinstance(m, TiledMLP)):
        base_forward = type(block)._tiled_base.forward

        def counted(module, x, _forward=base_forward):
            counts["inner"] += 1
            return _forward(module, x)

        # A subclass of the block's tiled class whose original forward counts: the tiled forward's
        # shard calls go through it, the block's hooks and attributes stay as they are.
        tiled_forward = type(block).forward

        def counted_tiled(module, x, _forward=tiled_forward):
            counts["tiled"] += 1
            return _forward(module, x)

        # The tiled call looks the original class's forward up at each call (``_tiled_base.forward``).
        counted_base = type("CountedBase", (type(block)._tiled_base,), {"forward": counted})
        block.__class__ = type("Counted", (type(block),), {"forward": counted_tiled, "_tiled_base": counted_base})
    return counts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_grads_equal_and_forward_counts(reentrant):
    """Two layers, 3 shards, generic path (the fast path never calls the inner forward per shard).

    Per step and per layer: without checkpointing, 1 TiledMLP call and 6 inner calls (3 shards forward
    + 3 shard recomputes in backward). With HF checkpointing the layer's forward is called twice (the
    forward, then the checkpoint's recompute). Non-reentrant: the recompute stops once the tiled call's
    input is saved, before its shard loop (the MLP is the last thing in a Llama layer that saves a
    tensor), so 6 inner calls: 2 MLP forwards per step, as without checkpointing. Reentrant (no early
    stop): 9 inner calls, the checkpoint's recompute running the shard loop too."""
    reference = tiny_model("llama")
    tiled = copy.deepcopy(reference)
    apply_tiled_mlp(tiled, num_shards=SHARDS, path="generic")
    plain = copy.deepcopy(tiled)
    for model in (reference, tiled):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
    ids = token_ids(1)
    counts = _count_inner_calls(tiled)
    plain_counts = _count_inner_calls(plain)
    reference(input_ids=ids, labels=ids).loss.backward()
    tiled(input_ids=ids, labels=ids).loss.backward()
    plain(input_ids=ids, labels=ids).loss.backward()
    layers = 2
    assert plain_counts == {"tiled": 1 * layers, "inner": 2 * SHARDS * layers}
    mlp_forwards = 3 if reentrant else 2
    assert counts == {"tiled": 2 * layers, "inner": mlp_forwards * SHARDS * layers}
    _assert_grads_equal(reference, tiled, rtol=1e-9, atol=1e-12, require=lambda key: True)


def _count_fast_shard_forwards(monkeypatch) -> dict:
    """Counts the fast kernel's shard forwards (the backward recomputes only gate and up, in
    backward_into, so these are the full MLP forwards)."""
    from tiled_mlp.core.kernels.gated import GatedShardKernel

    counts = {"forward_shard": 0}
    original = GatedShardKernel.forward_into

    def counted(self, *args, **kwargs):
        counts["forward_shard"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GatedShardKernel, "forward_into", counted)
    return counts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family, reentrant, full_forwards", [
    ("llama", False, 1),   # MLP then residual add: the recompute stops before the shard loop
    ("qwen2", False, 1),
    ("mistral", False, 1),
    ("llama", True, 2),    # reentrant: no early stop, the recompute runs the shard loop
    ("gemma2", False, 2),  # post_feedforward_layernorm saves the MLP's output: the recompute needs it
])
def test_fast_path_forwards_under_checkpointing_and_grads_exact(monkeypatch, family, reentrant, full_forwards):
    reference = tiny_model(family)
    tiled = copy.deepcopy(reference)
    report = apply_tiled_mlp(tiled, num_shards=SHARDS)
    for model in (reference, tiled):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
    ids = token_ids(4)
    reference(input_ids=ids, labels=ids).loss.backward()
    counts = _count_fast_shard_forwards(monkeypatch)
    tiled(input_ids=ids, labels=ids).loss.backward()
    assert set(report.paths().values()) == {"fast"}
    layers = 2
    assert counts["forward_shard"] == full_forwards * SHARDS * layers
    _assert_grads_equal(reference, tiled, rtol=1e-9, atol=1e-12, require=lambda key: True)


@pytest.mark.timeout(60)
def test_gradient_checkpointing_fast_path_grads_equal():
    reference = tiny_model("gemma")
    tiled = copy.deepcopy(reference)
    report = apply_tiled_mlp(tiled, num_shards=SHARDS)
    for model in (reference, tiled):
        model.gradient_checkpointing_enable()
    ids = token_ids(2)
    reference(input_ids=ids, labels=ids).loss.backward()
    tiled(input_ids=ids, labels=ids).loss.backward()
    assert set(report.paths().values()) == {"fast"}
    _assert_grads_equal(reference, tiled, rtol=1e-9, atol=1e-12, require=lambda key: True)


@pytest.mark.timeout(90)
def test_trainer_five_steps_loss_matches_untiled(tmp_path):
    from transformers import Trainer, TrainingArguments

    def run(tiled: bool):
        model = tiny_model("llama", dtype=torch.float32)
        if tiled:
            apply_tiled_mlp(model, num_shards=SHARDS)
        # Plain SGD: Adam's update barely moves when every gradient is off by the same factor.
        args = TrainingArguments(output_dir=str(tmp_path / str(tiled)), per_device_train_batch_size=2, max_steps=5,
                                 logging_steps=1, learning_rate=2.0, optim="sgd", report_to=[], save_strategy="no", use_cpu=True,
                                 seed=0, disable_tqdm=True, dataloader_num_workers=0, lr_scheduler_type="constant")
        trainer = Trainer(model=model, args=args, train_dataset=TokenRows(token_ids(3, batch=10, seq=13)))
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, model

    untiled_losses, _ = run(False)
    tiled_losses, model = run(True)
    assert len(untiled_losses) == 5
    assert untiled_losses[0] != untiled_losses[-1]  # it trained
    torch.testing.assert_close(torch.tensor(tiled_losses), torch.tensor(untiled_losses), rtol=1e-5, atol=1e-6)
    assert model.model.layers[0].mlp.tiling.last_path == "fast"


@pytest.mark.timeout(120)
def test_torch_compile_of_the_decoder_layers_loss_and_grads_equal():
    """Regional torch.compile (each decoder layer, the module around the tiled MLP, compiled in place
    with aot_eager: dynamo and AOT autograd, no C++ build) runs and gives the untiled loss and
    gradients. Compiling the whole model works the same way (measured: equal loss, 25 graph breaks)
    but takes over a minute on this CPU. Graph breaks are counted and printed, not asserted: they come
    from TiledMLP.forward's fake-tensor checks, its fast-path probe and RNG forking (see the report)."""
    from torch._dynamo.utils import counters

    reference = tiny_model("llama", dtype=torch.float32)
    tiled = copy.deepcopy(reference)
    apply_tiled_mlp(tiled, num_shards=SHARDS)
    ids = token_ids(4)
    torch._dynamo.reset()
    counters.clear()
    for layer in tiled.model.layers:
        layer.compile(backend="aot_eager")
    try:
        got = tiled(input_ids=ids, labels=ids).loss
        got.backward()
    finally:
        breaks = dict(counters["graph_break"])
        torch._dynamo.reset()
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    print(f"graph breaks: {sum(breaks.values())} in {len(breaks)} kinds: {[r.splitlines()[0] for r in breaks]}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _assert_grads_equal(reference, tiled, rtol=1e-4, atol=1e-6, require=lambda key: True)
    assert tiled.model.layers[0].mlp.tiling.last_num_shards == SHARDS
