"""What one rank of a DeepSpeed AutoTP engine (tensor_parallel.autotp_size 2, ZeRO stage 0, float32) does
with tiled MLPs and the tiled loss: two training steps of a model with tiled MLPs and the tiled loss against the
same engine untiled, and the outcome of a layer that does not gather its output given as the loss's head, as
(error class name, message), or "ran"."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

TOKENS = 23
HIDDEN = 16
VOCAB = 64


def autotp_llama() -> torch.nn.Module:
    """Two key-value heads, so that AutoTP splits attention evenly over 2 ranks too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=64))
    model.set_attn_implementation("eager")
    return model


def autotp_engine(model: torch.nn.Module):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"autotp_size": 2},
        "zero_allow_untested_optimizer": True,  # a plain torch SGD
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    return engine


def _outcome(attempt) -> Tuple[str, str]:
    try:
        attempt()
    except Exception as error:  # noqa: BLE001 - the outcome is what is recorded
        return type(error).__name__, str(error)
    return "ran", ""


def _steps(tiled: bool) -> Tuple[List[float], List[Dict[str, torch.Tensor]], object, List[str]]:
    """Two steps of the engine (SGD, lr 0.1) on fixed ids: each step's loss and every gradient, the engine, and
    the kernel of each tiled loss call."""
    import sys

    import tiled_mlp

    model = autotp_llama()
    loss_kernels: List[str] = []
    if tiled:
        # Before initialize: AutoTP then replaces the Linears inside the MLPs, and lm_head.
        tiled_mlp.apply_tiled_mlp(model, num_shards=3, loss=True, loss_num_shards=2)
        loss_module = sys.modules["tiled_mlp.core.tiled_loss"]
        reduce = loss_module.sharded_reduce

        def recorded(hidden, targets, scale, run, params):
            loss_kernels.append(type(run.kernel).__name__)
            return reduce(hidden, targets, scale, run, params)

        loss_module.sharded_reduce = recorded
    engine = autotp_engine(model)
    torch.manual_seed(1)
    batches = [torch.randint(0, VOCAB, (1, TOKENS)) for _ in range(STEPS)]
    losses, grads = [], []
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None})
        engine.step()
    return losses, grads, engine, loss_kernels


STEPS = 2


def tiled_blocks_under_autotp(rank: int, world_size: int) -> Dict[str, object]:
    import tiled_mlp

    want_losses, want_grads, _, _ = _steps(tiled=False)
    losses, grads, engine, loss_kernels = _steps(tiled=True)
    mlp = engine.module.model.layers[0].mlp
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, TOKENS))
    hidden = torch.randn(1, TOKENS, HIDDEN, requires_grad=True)
    grad_errors = [max(float((want[n] - have[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)) for n in want)
                   for want, have in zip(want_grads, grads, strict=True)]
    return {
        "mlp_layers": {name: type(child).__name__ for name, child in mlp.named_children()},
        "head_layer": type(engine.module.lm_head).__name__,
        "loss_errors": [abs(w - h) / abs(w) for w, h in zip(want_losses, losses, strict=True)],
        "grad_errors": grad_errors,
        "grads_compared": len(want_grads[0]) == len(grads[0]),
        "mlp_last_path": mlp.tiling.last_path,
        "mlp_num_shards": mlp.tiling.last_num_shards,
        "loss_kernels": list(loss_kernels),  # the two steps' (the calls below add theirs)
        # up_proj keeps its rows' outputs on this rank: as a head, each rank would see a slice of the logits.
        "split_head": _outcome(lambda: tiled_mlp.tiled_cross_entropy(hidden, mlp.up_proj, ids, num_shards=2)),
        "row_head_errors": _row_head_errors(mlp.down_proj),
    }


def _row_head_errors(row_layer: torch.nn.Module) -> List[float]:
    """A row-parallel layer (``LinearAllreduce``: every output row, its output all-reduced) as the loss's head,
    its outputs taken for a vocabulary of HIDDEN: the tiled loss and its input gradient against the plain
    cross-entropy of the layer's own output (relative errors)."""
    import torch.nn.functional as F

    import tiled_mlp

    torch.manual_seed(2)
    local_in = torch.randn(1, TOKENS, row_layer.weight.shape[1], requires_grad=True)
    labels = torch.randint(0, HIDDEN, (1, TOKENS))
    logits = row_layer(local_in)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, HIDDEN), labels[:, 1:].reshape(-1))
    (want_dx,) = torch.autograd.grad(want, local_in)
    have = tiled_mlp.tiled_cross_entropy(local_in, row_layer, labels, num_shards=3)
    (have_dx,) = torch.autograd.grad(have, local_in)
    return [float((want - have).abs() / want.abs()), float((want_dx - have_dx).abs().max() / want_dx.abs().max())]
