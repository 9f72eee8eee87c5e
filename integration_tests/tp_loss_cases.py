"""What each rank runs for ``test_loss_tensor_parallel.py``: the tiled loss of a vocabulary-parallel
``lm_head`` (``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``, torchtitan's layout)
against the same loss on the whole head in the same process, float64.

The hidden states come out of a small replicated projection (a plain ``nn.Linear`` on every rank), so
the head's input gradient, a partial sum on each rank until autograd all-reduces it, reaches a parameter
whose gradient must then be the same as one process's. Every case returns, per compared tensor, the
relative error ``max |diff| / max |reference|`` on this rank.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .comparison import rel_error

HIDDEN, VOCAB = 12, 51  # 51 rows over 2 ranks: 26 and 25 (an uneven split)
# Even, so that a sequence-parallel input splits evenly (DTensor.from_local assumes even shards).
TOKENS = 18
CASES: Dict[str, Dict[str, Any]] = {
    "plain": {},
    "label_smoothing": dict(label_smoothing=0.1),
    "logit_softcap": dict(logit_softcap=2.0),
    "z_loss": dict(z_loss=0.05),
    "num_items_in_batch": dict(num_items_in_batch=23),
    "ignore_index": dict(ignore_index=7, ignored=9),  # a class id as ignore_index: 9 ignored tokens and any other 7
    "sum_reduction": dict(reduction="sum"),
    "bias": dict(bias=True),
    "every_option": dict(bias=True, label_smoothing=0.2, logit_softcap=3.0, z_loss=0.01, num_items_in_batch=19),
    "one_shard": dict(num_shards=1),
    "auto_shards": dict(num_shards="auto"),
    "sequence_parallel_input": dict(sequence_parallel=True),
}
LOSS_KEYS = ("ignore_index", "reduction", "num_items_in_batch", "label_smoothing", "logit_softcap", "z_loss", "num_shards")


def _proj_and_head(bias: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(dict(proj=nn.Linear(HIDDEN, HIDDEN), lm_head=nn.Linear(HIDDEN, VOCAB, bias=bias))).double()


def _case_inputs(case: Dict[str, Any], seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, TOKENS, HIDDEN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (2, TOKENS), generator=generator)
    ignore = case.get("ignore_index", -100)
    labels[0, : case.get("ignored", 3)] = ignore  # rows with different counts of valid tokens
    return x, labels


def tp_reference_loss(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, case: Dict[str, Any]) -> torch.Tensor:
    """The loss on the whole head, written out from its definitions: F.cross_entropy (with its label
    smoothing) on the soft-capped logits, plus the z-loss, over the shifted labels."""
    logits = model["lm_head"](model["proj"](x))
    cap = case.get("logit_softcap")
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    ignore = case.get("ignore_index", -100)
    targets = F.pad(labels, (0, 1), value=ignore)[..., 1:].reshape(-1)
    flat = logits.reshape(-1, VOCAB)
    loss = F.cross_entropy(flat, targets, ignore_index=ignore, reduction="sum",
                           label_smoothing=case.get("label_smoothing", 0.0))
    valid = targets != ignore
    loss = loss + case.get("z_loss", 0.0) * torch.logsumexp(flat[valid], dim=-1).square().sum()
    if case.get("num_items_in_batch") is not None:
        return loss / case["num_items_in_batch"]
    return loss if case.get("reduction") == "sum" else loss / valid.sum()


def _parallel(model: nn.Module, mesh, sequence_parallel: bool) -> nn.Module:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    style = ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else None, output_layouts=Shard(-1),
                            use_local_output=False)
    parallelize_module(model["lm_head"], mesh, style)
    return model


def _tiled_loss(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, case: Dict[str, Any], rank: int, world: int):
    from tiled_mlp.core import tiled_cross_entropy

    hidden = model["proj"](x)
    if case.get("sequence_parallel"):
        hidden = hidden.chunk(world, dim=1)[rank]  # this rank's tokens; the head's hook gathers them
    options = {k: case[k] for k in LOSS_KEYS if k in case}
    options.setdefault("num_shards", 3)
    return tiled_cross_entropy(hidden, model["lm_head"], labels, **options)


def _full_grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for name, p in model.named_parameters()}


def _params(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def _prefixed_errors(prefix: str, want: Dict[str, torch.Tensor], have: Dict[str, torch.Tensor]) -> Dict[str, float]:
    return {f"{prefix}{name}": rel_error(want[name], have[name]) for name in want}


def _sum_sequence_parallel_grads(model: nn.Module, x: torch.Tensor) -> None:
    """A sequence-parallel input: each rank's projection saw its own tokens, so its gradients (and x's)
    are that rank's part; summed over the ranks, as sequence-parallel training reduces them, they are
    the whole sequence's."""
    import torch.distributed as dist

    for tensor in (x.grad, *(p.grad for p in model["proj"].parameters())):
        dist.all_reduce(tensor)


def option_cases(rank: int, world: int, names: List[str]) -> Dict[str, Dict[str, float]]:
    """Per case: the loss, dx and every parameter's gradient against one process on the whole head."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out: Dict[str, Dict[str, float]] = {}
    for name in names:
        case = CASES[name]
        reference = _proj_and_head(case.get("bias", False))
        model = _parallel(copy.deepcopy(reference), mesh, bool(case.get("sequence_parallel")))
        x, labels = _case_inputs(case, seed=1)
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = tp_reference_loss(reference, x_ref, labels, case)
        want.backward()
        have = _tiled_loss(model, x_tp, labels, case, rank, world)
        have.backward()
        if case.get("sequence_parallel"):
            _sum_sequence_parallel_grads(model, x_tp)
        errors = {"loss": rel_error(want.detach(), have.detach()), "dx": rel_error(x_ref.grad, x_tp.grad)}
        errors.update(_prefixed_errors("d_", _full_grads(reference), _full_grads(model)))
        out[name] = errors
    return out


def sgd_steps(rank: int, world: int, steps: int) -> List[Dict[str, float]]:
    """``steps`` SGD steps on a model with every option: per step, the loss, the gradients and the
    parameters after the step, against one process."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    case = CASES["every_option"]
    reference = _proj_and_head(True)
    model = _parallel(copy.deepcopy(reference), mesh, False)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model)]
    out = []
    for step in range(steps):
        x, labels = _case_inputs(case, seed=10 + step)
        want = tp_reference_loss(reference, x, labels, case)
        want.backward()
        have = _tiled_loss(model, x, labels, case, rank, world)
        have.backward()
        errors = {"loss": rel_error(want.detach(), have.detach())}
        errors.update(_prefixed_errors("d_", _full_grads(reference), _full_grads(model)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        errors.update(_prefixed_errors("param_", _params(reference), _params(model)))
        out.append(errors)
    return out


def tp_loss_refusals(rank: int, world: int) -> Dict[str, Optional[str]]:
    """The error each unsupported layout raises (None: none was raised), before any loss work."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel, parallelize_module

    from tiled_mlp.core import tiled_cross_entropy

    mesh = init_device_mesh("cpu", (world,))
    x, labels = _case_inputs({}, seed=1)

    heads = {
        "sharded_on_hidden": parallelize_module(_proj_and_head(False)["lm_head"], mesh, RowwiseParallel()),
        "replicated_by_style": parallelize_module(_proj_and_head(False)["lm_head"], mesh, SequenceParallel()),
        # No partition function: every parameter Replicate, and no hooks.
        "dtensor_without_style": distribute_module(_proj_and_head(False)["lm_head"], mesh),
    }
    out: Dict[str, Optional[str]] = {}
    for name, head in heads.items():
        try:
            tiled_cross_entropy(x, head, labels, num_shards=2)
        except (RuntimeError, ValueError) as error:
            out[name] = str(error)
        else:
            out[name] = None
    return out
