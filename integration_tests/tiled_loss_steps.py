"""The steps every tiled-loss training test here takes, whatever prepares the model: the tiny transformers
Llama, tiled by the flags as a training script takes them (``add_tiled_mlp_args`` -> ``apply_from_flags``: the
tiled loss, MLPs and norms), two SGD steps on different tokens per rank. A run records its losses, every
parameter's full gradient at each step, every full parameter after it, and the all-gathers and
reduce-scatters each step issued. The untiled run computes its loss from the logits in float64 by hand
(transformers' own loss is float32 math), so a float64 run is compared exactly; ``steps_reference_run`` is one
process untiled.
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

STEPS, LR = 2, 0.5
FLAGS = ["--use_tiled_loss", "true", "--use_tiled_mlp", "true", "--use_tiled_norms", "true",
         "--tiled_mlp_num_shards", "3"]


def rank_step_ids(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s tokens at ``step``: a different count per rank."""
    from integration_tests.tiny_models import VOCAB

    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (1, 9 + 6 * rank), generator=generator)


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy, in the logits' dtype (float64 for a float64 model)."""
    return F.cross_entropy(logits[0, :-1], ids[0, 1:])


def tiled_by_flags(model: torch.nn.Module, flags: List[str] = FLAGS) -> None:
    from tiled_mlp.integrations import add_tiled_mlp_args, apply_from_flags

    args = add_tiled_mlp_args(argparse.ArgumentParser()).parse_args(flags)
    assert apply_from_flags(model, args) is not None


def build_loss_model(dtype: torch.dtype = torch.float64, tied: bool = False) -> torch.nn.Module:
    """The tiny Llama; ``tied``: its head's weight is the embeddings' (as ``tie_word_embeddings`` makes it)."""
    from integration_tests.tiny_models import tiny_model

    model = tiny_model("llama", dtype=dtype)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def steps_reference_run(world_size: int, dtype: torch.dtype = torch.float64, tied: bool = False) -> Dict:
    """One process, untiled: each step's loss is the ranks' mean, as data parallelism averages gradients."""
    model = build_loss_model(dtype, tied)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    record: Dict = {"losses": [], "grads": [], "params": []}
    for step in range(STEPS):
        losses = [causal_lm_loss(model(input_ids=rank_step_ids(rank, step)).logits, rank_step_ids(rank, step))
                  for rank in range(world_size)]
        torch.stack(losses).mean().backward()
        record["losses"].append([loss.detach() for loss in losses])
        record["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        record["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return record


class CollectiveCount:
    """Counts the all-gathers and reduce-scatters issued through ``torch.distributed`` while on (FSDP2 calls
    ``all_gather_single`` / ``reduce_scatter_single`` in torch 2.13, the ``*_tensor`` ones before)."""

    ALL_GATHERS = ("all_gather_into_tensor", "all_gather_single")
    REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single")

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.originals = {name: getattr(dist, name) for name in self.ALL_GATHERS + self.REDUCE_SCATTERS
                          if hasattr(dist, name)}
        self.counts = dict.fromkeys(("all_gather", "reduce_scatter"), 0)

    def __enter__(self):
        for name, original in self.originals.items():
            setattr(self.dist, name, self._counting(name, original))
        return self

    def _counting(self, name, original):
        kind = "all_gather" if name in self.ALL_GATHERS else "reduce_scatter"

        def call(*args, **kwargs):
            self.counts[kind] += 1
            return original(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(self.dist, name, original)


def run_steps(model: torch.nn.Module, named, tiled: bool, rank: int, backward: Callable, optimizer,
              full_grad: Callable, full_param: Callable) -> Dict:
    """``STEPS`` steps of ``model`` (prepared by a backend; ``named``: its parameters by their own names)."""
    record: Dict = {"losses": [], "grads": [], "params": [], "collectives": []}
    for step in range(STEPS):
        ids = rank_step_ids(rank, step)
        with CollectiveCount() as count:
            if tiled:
                out = model(input_ids=ids, labels=ids)
                assert out.logits is None  # the tiled loss ran: no logits
                loss = out.loss
            else:
                loss = causal_lm_loss(model(input_ids=ids).logits, ids)
            backward(loss)
        record["collectives"].append(dict(count.counts))
        record["losses"].append(loss.detach().clone())
        record["grads"].append({n: full_grad(p) for n, p in named})
        optimizer.step()
        optimizer.zero_grad()
        record["params"].append({n: full_param(p) for n, p in named})
    return record


def step_mismatches(got: Dict, want: Dict, what: str, rank: int, rtol: float, atol: float) -> List[str]:
    """Every loss, gradient and parameter of ``got`` that differs from ``want`` (``want``'s losses: the ranks'
    per step, as ``steps_reference_run`` records them, or this rank's own)."""
    failures = []
    for step in range(len(want["grads"])):
        want_loss = want["losses"][step]
        want_loss = want_loss[rank] if isinstance(want_loss, list) else want_loss
        if not torch.allclose(got["losses"][step].double(), want_loss.double(), rtol=rtol, atol=atol):
            failures.append(f"rank {rank} step {step} loss vs {what}: {got['losses'][step]} != {want_loss}")
        for kind in ("grads", "params"):
            assert got[kind][step].keys() == want[kind][step].keys()
            for name, value in want[kind][step].items():
                have = got[kind][step][name].double()
                if not torch.allclose(have, value.double(), rtol=rtol, atol=atol):
                    error = (have - value.double()).abs().max().item()
                    failures.append(f"rank {rank} step {step} {kind} {name} vs {what}: max error {error:.3g}")
    return failures


def max_error(got: Dict, want: Dict, rank: int) -> float:
    """The largest difference between two records' losses, gradients and parameters."""
    errors = []
    for step in range(len(want["grads"])):
        want_loss = want["losses"][step]
        want_loss = want_loss[rank] if isinstance(want_loss, list) else want_loss
        errors.append((got["losses"][step].double() - want_loss.double()).abs().item())
        for kind in ("grads", "params"):
            errors += [(got[kind][step][n].double() - v.double()).abs().max().item() for n, v in want[kind][step].items()]
    return max(errors)
