"""The tiny transformers Llama under FSDP2 on 2 gloo ranks, tiled by ``apply_tiled_mlp`` before
``fully_shard`` (each decoder layer, then the root): after each of 2 SGD steps every full gradient,
and every full parameter after the steps, equals the untiled FSDP2 run (same seed, same data per
rank), in float64. With ``loss=True`` as well: the tiled loss runs inside the root's forward, with
``lm_head`` in the root's FSDP2 group.

Hugging Face's loss casts the logits to float32 (``logits.float()``); both runs patch that cast away
(``Tensor.float`` kept float64) so that the untiled loss is float64 too, as the tiled loss is."""
from __future__ import annotations

import pytest
import torch

from .comparison import float_kept_float64
from .spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

STEPS, SHARDS, LR = 2, 3, 0.5


def _train_float64(rank: int, world_size: int, tiled: bool, loss: bool = False) -> dict:

    with float_kept_float64():
        return _train_steps(rank, world_size, tiled, loss)


def _train_steps(rank: int, world_size: int, tiled: bool, loss: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from integration_tests.tiny_models import VOCAB, tiny_model
    from tiled_mlp.integrations import apply_tiled_mlp

    model = tiny_model("llama", seed=0, dtype=torch.float64)
    report = apply_tiled_mlp(model, num_shards=SHARDS, loss=loss, loss_num_shards=SHARDS) if tiled else None
    blocks = report.patched if report is not None else []
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    grads, losses = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 11), generator=generator)
        out = model(input_ids=ids, labels=ids)
        logits_returned = out.logits is not None  # the tiled loss returns none: it never held them
        loss = out.loss
        loss.backward()
        losses.append(loss.item())
        # state_dict keys are the same tiled or not, so the two runs line up by key.
        grads.append({k: p.grad.full_tensor() for k, p in model.state_dict(keep_vars=True).items()
                      if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = {k: p.full_tensor().detach() for k, p in model.state_dict().items()}
    return {"grads": grads, "params": params, "losses": losses, "logits_returned": logits_returned,
            "paths": sorted({(b.name, b.tiled.tiling.last_path, type(b.tiled.tiling.last_strategy).__name__) for b in blocks})}


def _train_both(rank: int, world_size: int) -> dict:
    return {"untiled": _train_float64(rank, world_size, False), "tiled": _train_float64(rank, world_size, True),
            "tiled_loss": _train_float64(rank, world_size, True, loss=True)}


@pytest.mark.timeout(300)
def test_llama_fsdp2_tiled_equals_untiled_after_two_steps(tmp_path):
    results = run_distributed(_train_both, 2, tmp_path, timeout=260)
    for rank, result in enumerate(results):
        for variant in ("tiled", "tiled_loss"):
            _assert_same_run(rank, result["untiled"], result[variant])
        assert result["tiled"]["logits_returned"] and not result["tiled_loss"]["logits_returned"]


def _assert_same_run(rank: int, want: dict, got: dict) -> None:
    assert [p[1] for p in got["paths"]] == ["fast", "fast"], got["paths"]
    assert {p[2] for p in got["paths"]} == {"FSDP2Strategy"}, got["paths"]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-10, atol=0)
    for step, (want_grads, got_grads) in enumerate(zip(want["grads"], got["grads"], strict=True)):
        assert want_grads.keys() == got_grads.keys() and len(want_grads) == len(want["params"])
        for key, want_grad in want_grads.items():
            assert want_grad.abs().max() > 0, f"step {step} {key}: zero gradient"
            torch.testing.assert_close(got_grads[key], want_grad, rtol=1e-9, atol=1e-12,
                                       msg=f"rank {rank} step {step} grad {key}")
    for key, want_param in want["params"].items():
        torch.testing.assert_close(got["params"][key], want_param, rtol=1e-9, atol=1e-12,
                                   msg=f"rank {rank} param {key}")
