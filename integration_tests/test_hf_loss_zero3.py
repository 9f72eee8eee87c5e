"""``apply_tiled_loss`` on the tiny transformers Llama (its own, untied ``lm_head``) under DeepSpeed ZeRO-3
on 2 gloo ranks: the tiled loss runs inside the partitioned ``lm_head``'s own call, so ZeRO-3's hooks on
``lm_head`` gather it around the loss and again for its backward. Two SGD steps on different data per rank: losses and every full parameter equal the
untiled ZeRO-3 run (float32; Hugging Face's loss is float32 math either way)."""
from __future__ import annotations

import pytest
import torch

from .spawn import run_distributed

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

STEPS, LR = 2, 0.5


def _train_zero3(rank: int, tiled: bool) -> dict:
    import deepspeed

    from integration_tests.tiny_models import VOCAB, tiny_model
    from integration_tests.zero_training import full_param
    from tiled_mlp import apply_tiled_loss

    model = tiny_model("llama", seed=0, dtype=torch.float32)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied: gathered by nobody else
    if tiled:
        apply_tiled_loss(model, num_shards=3)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)
    generator = torch.Generator().manual_seed(100 + rank)
    losses, logits_returned = [], []
    for _step in range(STEPS):
        ids = torch.randint(0, VOCAB, (1, 9 + 6 * rank), generator=generator)  # unequal tokens per rank
        out = engine(input_ids=ids, labels=ids)
        logits_returned.append(out.logits is not None)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    params = {n: full_param(p) for n, p in model.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "logits_returned": logits_returned}


def _both(rank: int, world_size: int) -> dict:
    return {"untiled": _train_zero3(rank, False), "tiled": _train_zero3(rank, True)}


@pytest.mark.timeout(300)
def test_hf_llama_tiled_loss_under_zero3_equals_untiled(tmp_path):
    for rank, result in enumerate(run_distributed(_both, 2, tmp_path, timeout=260)):
        want, got = result["untiled"], result["tiled"]
        assert got["logits_returned"] == [False] * STEPS and want["logits_returned"] == [True] * STEPS
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=0)
        assert want["params"].keys() == got["params"].keys()
        for name, param in want["params"].items():
            torch.testing.assert_close(got["params"][name], param, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
