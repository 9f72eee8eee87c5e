"""``torch.compile(model, fullgraph=True)`` of a tiled Hugging Face model at several sequence lengths, with
Dynamo's default dynamic shapes: from the second length on Dynamo makes the token dimension symbolic
(automatic dynamic shapes), and a symbolic size given to a decision made where traced once stopped the
compile (``Unsupported: assume_constant_result argument conversion failed ... by_object``, naming neither
this library nor a fix). Each size is now specialized (``dynamo_support._specialized``): every new length
traces the call again, exact (float64, against the untiled model in eager mode)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from integration_tests.sp_cases import hf_loss64  # noqa: E402
from integration_tests.tiny_models import VOCAB, tiny_model  # noqa: E402
from tiled_mlp import apply_tiled_mlp  # noqa: E402

BOUND = 1e-10  # float64: the tiled and untiled runs differ by a few ulps (measured: loss equal, gradients 5.6e-16)
LENGTHS = (16, 24, 40)  # the second is where automatic dynamic shapes make the length symbolic


def _models():
    reference = tiny_model("llama", seed=0, dtype=torch.float64)
    reference.set_attn_implementation("sdpa")  # float64 throughout (eager attention's softmax is float32)
    del reference.model.layers[1:]  # one layer: compiling is most of the time, a second layer tests nothing more
    reference.config.num_hidden_layers = 1
    tiled = copy.deepcopy(reference)
    apply_tiled_mlp(tiled, num_shards=2, loss=True, loss_num_shards=3, norms=True)
    return reference, tiled


def _check(compiled, reference, tiled, tokens: int) -> None:
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    labels = ids.clone()
    labels[0, :3] = -100
    got = compiled(input_ids=ids, labels=labels)
    got.loss.backward()
    want = hf_loss64(reference(input_ids=ids).logits, labels)  # HF's own loss takes float32 logits
    want.backward()
    assert abs(got.loss.item() - want.item()) <= BOUND * abs(want.item()), tokens
    for (name, p), q in zip(reference.named_parameters(), tiled.parameters(), strict=True):
        err = (q.grad - p.grad).abs().max() / p.grad.abs().max()
        assert err <= BOUND, (tokens, name, float(err))
    reference.zero_grad()
    tiled.zero_grad()


@pytest.mark.timeout(120)
def test_fullgraph_compile_at_a_second_and_third_length_is_exact():
    torch._dynamo.reset()
    reference, tiled = _models()
    compiled = torch.compile(tiled, backend="aot_eager", fullgraph=True)
    for tokens in LENGTHS:
        _check(compiled, reference, tiled, tokens)
    # The decisions saw plain sizes: the MLP's last route is the one decided at the last length.
    assert tiled.model.layers[0].mlp.tiling.compiled_reason
    torch._dynamo.reset()


@pytest.mark.timeout(120)
def test_fullgraph_compile_with_dynamic_true_is_exact():
    """``dynamic=True`` makes the length symbolic at the first call already."""
    torch._dynamo.reset()
    reference, tiled = _models()
    compiled = torch.compile(tiled, backend="aot_eager", fullgraph=True, dynamic=True)
    for tokens in LENGTHS[:2]:
        _check(compiled, reference, tiled, tokens)
    torch._dynamo.reset()
