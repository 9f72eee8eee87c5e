"""Per family: a tiny transformers causal LM tiled by ``apply_tiled_mlp`` gives the same logits, loss
and every parameter gradient as the untiled model, in float64 on CPU (batch 2, odd sequence length,
3 shards that do not divide the 26 tokens evenly)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from integration_tests.tiny_models import FAMILIES, VOCAB, grads_by_key, tiny_model  # noqa: E402
from tiled_mlp import TiledMLP  # noqa: E402
from tiled_mlp.integrations import apply_tiled_mlp  # noqa: E402

# float64 end to end: only summation order differs between tiled and untiled.
RTOL, ATOL = 1e-9, 1e-12
BATCH, SEQ, SHARDS = 2, 13, 3


def _cotangent_step(model, input_ids, cotangent):
    out = model(input_ids=input_ids, labels=input_ids)
    # A random cotangent on the logits reaches every logit position; the loss is checked on its own.
    (out.loss + (out.logits * cotangent).sum()).backward()
    return out


def _assert_within_bound(want, got, what):
    assert got.shape == want.shape, what
    bound = RTOL * want.abs().max().item() + ATOL
    err = (got - want).abs().max().item()
    assert err <= bound, f"{what}: max |diff| {err:.3g} > {bound:.3g}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiled_family_matches_untiled_in_float64(family):
    reference = tiny_model(family)
    tiled = copy.deepcopy(reference)
    report = apply_tiled_mlp(tiled, num_shards=SHARDS)
    assert len(report.patched) == FAMILIES[family].blocks, str(report)
    assert all(isinstance(block.tiled, TiledMLP) for block in report.patched)

    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    cotangent = torch.randn(BATCH, SEQ, VOCAB, generator=generator, dtype=torch.float64)
    want = _cotangent_step(reference, input_ids, cotangent)
    got = _cotangent_step(tiled, input_ids, cotangent)

    _assert_within_bound(want.logits, got.logits, "logits")
    _assert_within_bound(want.loss, got.loss, "loss")
    want_grads, got_grads = grads_by_key(reference), grads_by_key(tiled)
    assert want_grads.keys() == got_grads.keys()
    for key, want_grad in want_grads.items():
        if want_grad is None:
            assert got_grads[key] is None, f"{key}: tiled has a gradient the untiled model has not"
            continue
        assert got_grads[key] is not None, f"{key}: no gradient in the tiled model"
        _assert_within_bound(want_grad, got_grads[key], f"grad of {key}")
    # Every MLP weight has a non-zero gradient, so the comparison above compared something.
    mlp_grads = [g for k, g in want_grads.items() if ".mlp." in k and g is not None]
    assert mlp_grads and all(g.abs().max() > 0 for g in mlp_grads)

    paths = {block.name: block.tiled.tiling.last_path for block in report.patched}
    assert all(block.tiled.tiling.last_num_shards == SHARDS for block in report.patched)
    expected = FAMILIES[family].expected_path
    if expected == "mixed":  # Qwen3-MoE tiny config: layer 0's experts (generic), layer 1 dense (fast)
        assert paths == {"model.layers.0.mlp.experts": "generic", "model.layers.1.mlp": "fast"}
    else:
        assert set(paths.values()) == {expected}, paths


@pytest.mark.timeout(60)
def test_moe_router_aux_loss_and_router_grads_match():
    """Only the experts are tiled, so the router runs once on the whole sequence: the auxiliary
    load-balancing loss keeps its graph and the router's gradient (through the routing weights into
    the tiled experts, and through the aux loss) agrees."""
    reference = tiny_model("mixtral")
    reference.config.output_router_logits = True
    reference.config.router_aux_loss_coef = 0.5
    tiled = copy.deepcopy(reference)
    apply_tiled_mlp(tiled, num_shards=SHARDS)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    want = reference(input_ids=input_ids, labels=input_ids)
    got = tiled(input_ids=input_ids, labels=input_ids)
    assert want.aux_loss is not None and want.aux_loss > 0
    assert got.aux_loss.grad_fn is not None
    _assert_within_bound(want.aux_loss, got.aux_loss, "aux loss")
    want.loss.backward()
    got.loss.backward()
    for key, want_grad in grads_by_key(reference).items():
        if ".gate." in key:
            assert want_grad.abs().max() > 0
            _assert_within_bound(want_grad, grads_by_key(tiled)[key], f"grad of {key}")
