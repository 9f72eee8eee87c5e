"""``apply_tiled_loss`` on the tiny transformers Llama under DeepSpeed ZeRO-3, 2 gloo ranks: ``lm_head`` is
gathered only around its own work, as ZeRO-3 gathers any module, never held through the step.

The tiled loss runs inside ``lm_head``'s own call, so ZeRO-3's hooks on ``lm_head`` gather its weight
before the loss, release it after, gather it again for the loss's backward and release it once the
hidden states' gradient is out. Checked by DeepSpeed's own status field (``ds_status``), read by hooks
at three points where ``lm_head`` has no work: in the first decoder layer's forward, right after the
model's forward returns, and when the gradient reaches the last decoder layer's output (the decoder's
backward, after ``lm_head``'s). The
untiled ZeRO-3 run is the control: its weight is partitioned at both points as well.

And the loss and every full gradient (``safe_get_full_grad``, averaged over the ranks) equal a
single-process float64 reference of both ranks' batches within ``ZERO_BOUND``, two SGD steps, untied
and tied (``lm_head.weight is embed_tokens.weight``).
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from .comparison import ZERO_BOUND, ZERO_DTYPE, needs_deepspeed, rel_error
from .spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, needs_deepspeed]

STEPS, LR, SHARDS = 2, 0.5, 3
CASES = {"tiled": (True, False), "tiled_tied": (True, True), "untiled": (False, False)}  # name: (tiled, tied)


def _llama_maybe_tied(tied: bool, dtype: torch.dtype):
    from integration_tests.tiny_models import tiny_model

    model = tiny_model("llama", seed=0, dtype=dtype)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
        model.config.tie_word_embeddings = True
    return model


def _rank_ids(rank: int, step: int) -> torch.Tensor:
    from integration_tests.tiny_models import VOCAB

    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (1, 9 + 6 * rank), generator=generator)  # unequal tokens per rank


def _reference(tied: bool, world: int) -> Dict[str, List]:
    """float64, one process: each step's per-rank losses and the gradients averaged over the ranks (as
    ZeRO reduces them), then a plain SGD step."""
    model = _llama_maybe_tied(tied, torch.float64)
    losses, grads = [], []
    for step in range(STEPS):
        model.zero_grad()
        step_losses = []
        for rank in range(world):
            ids = _rank_ids(rank, step)
            loss = model(input_ids=ids, labels=ids).loss
            (loss / world).backward()
            step_losses.append(loss.detach())
        losses.append(step_losses)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {"losses": losses, "grads": grads}


def _status_recorders(model, seen: Dict[str, List[str]]):
    """Hooks that record ``lm_head.weight``'s ``ds_status`` in the first decoder layer's forward (before
    ``lm_head`` runs), and when the gradient reaches the last decoder layer's output (the decoder's
    backward has begun, ``lm_head``'s is over)."""
    weight = model.lm_head.weight

    def in_layer(_module, _args):
        seen["decoder_forward"].append(weight.ds_status.name)

    def on_layer_output(_module, _args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: seen["decoder_backward"].append(weight.ds_status.name))

    return [model.model.layers[0].register_forward_pre_hook(in_layer),
            model.model.layers[-1].register_forward_hook(on_layer_output)]


def _engine_run(tiled: bool, tied: bool, rank: int) -> Dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from tiled_mlp import apply_tiled_loss

    model = _llama_maybe_tied(tied, ZERO_DTYPE)
    if tiled:
        apply_tiled_loss(model, num_shards=SHARDS)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "steps_per_print": 10**9,
              # Persistence 0: else the tiny model's parameters would stay whole. Reuse distance and prefetch
              # 0: ZeRO-3 then releases a module's parameters at its hooks and fetches nothing ahead, so a
              # status read between modules shows what the hooks hold, not DeepSpeed's caching.
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)
    seen: Dict[str, List[str]] = {"decoder_forward": [], "after_forward": [], "decoder_backward": []}
    handles = _status_recorders(model, seen)
    losses, grads = [], []
    for step in range(STEPS):
        ids = _rank_ids(rank, step)
        out = engine(input_ids=ids, labels=ids)
        seen["after_forward"].append(model.lm_head.weight.ds_status.name)
        engine.backward(out.loss)
        grads.append({n: safe_get_full_grad(p).detach().double().clone() for n, p in model.named_parameters()})
        engine.step()
        losses.append(out.loss.detach().double())
    for handle in handles:
        handle.remove()
    # ZeRO-3 keys a module's external parameters by id: the root's hooks would fetch lm_head's weight.
    held_by_root = id(model.lm_head.weight) in getattr(model, "_external_params", {})
    engine.destroy()
    return {"losses": losses, "grads": grads, "seen": seen, "held_by_root": held_by_root}


def _all_cases(rank: int, world: int) -> Dict:
    runs = {name: _engine_run(tiled, tied, rank) for name, (tiled, tied) in CASES.items()}
    refs = {tied: _reference(tied, world) for tied in (False, True)}
    errors = {}
    for name, (_, tied) in CASES.items():
        run, ref = runs[name], refs[tied]
        worst = 0.0
        for step in range(STEPS):
            worst = max(worst, rel_error(ref["losses"][step][rank], run["losses"][step]))
            for param, want in ref["grads"][step].items():
                worst = max(worst, rel_error(want, run["grads"][step][param]))
        errors[name] = worst
    return {"errors": errors, "seen": {name: run["seen"] for name, run in runs.items()},
            "held_by_root": {name: run["held_by_root"] for name, run in runs.items()}}


@pytest.mark.timeout(200)
def test_tiled_loss_under_zero3_leaves_lm_head_partitioned_outside_its_own_work(tmp_path):
    results = run_distributed(_all_cases, 2, tmp_path, timeout=180)
    for rank, result in enumerate(results):
        print(f"rank {rank}: worst relative error vs float64 {result['errors']}; lm_head.weight status {result['seen']}")
    for rank, result in enumerate(results):
        for name, seen in result["seen"].items():
            assert seen == {point: ["NOT_AVAILABLE"] * STEPS for point in seen}, (rank, name, seen)
        assert not any(result["held_by_root"].values()), (rank, result["held_by_root"])
        for name, error in result["errors"].items():
            assert error <= ZERO_BOUND, (rank, name, error)
