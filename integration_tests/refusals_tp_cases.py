"""What each rank runs for ``test_refusals_tp.py``: tensor-parallel layouts the library refuses, each built the way
a user would get there (torch's ``parallelize_module``, a parameter set on the module afterwards, Hugging Face's
``tp_plan``), and the text of the error each raises (``raised``: ``("", "nothing raised")`` where none was)."""
from __future__ import annotations

from typing import Dict, Tuple
from unittest import mock

import torch
from torch import nn

from .sp_cases import raised
from .tp_cases import tiled_norm_outcome
from .tp_loss_cases import HIDDEN, VOCAB, _case_inputs, _proj_and_head

SEQ = 8


def _sequence_parallel_norm(mesh, sequence_dim: int = 1) -> nn.Module:
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    norm = nn.RMSNorm(HIDDEN, dtype=torch.float64)
    return parallelize_module(norm, mesh, SequenceParallel(sequence_dim=sequence_dim, use_local_output=True))


def norm_refusals(rank: int, world: int) -> Dict[str, str]:
    """A tiled RMSNorm under ``SequenceParallel`` handed an input it cannot compute on: a DTensor on another mesh
    (the style's input hook keeps a DTensor already sharded as it wants, whatever its mesh), and the hidden
    dimension sharded (``sequence_dim=2``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("other",))  # the same ranks, another mesh
    local = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    on_other_mesh = DTensor.from_local(local, other, [Shard(1)], run_check=False)
    return {"other_mesh": tiled_norm_outcome(_sequence_parallel_norm(mesh), on_other_mesh),
            "hidden_sharded": tiled_norm_outcome(_sequence_parallel_norm(mesh, sequence_dim=2),
                                                 local[..., : HIDDEN // world])}


def _colwise_head(mesh, bias: bool = False) -> nn.Module:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    head = _proj_and_head(bias)["lm_head"]
    return parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))


def _loss_outcome(head: nn.Module, **kwargs) -> Tuple[str, str]:
    """The tiled loss's error on ``head``, and whether the head's gradients stayed untouched (nothing ran)."""
    from tiled_mlp.core import tiled_cross_entropy

    x, labels = _case_inputs({}, seed=1)
    if "sequence_group" in kwargs:
        kwargs["shift_labels"] = labels
    else:
        kwargs["labels"] = labels
    kind, message = raised(lambda: tiled_cross_entropy(x, head, num_shards=2, **kwargs))
    untouched = all(p.grad is None for p in head.parameters())
    return kind, message if untouched else "work was done: " + message


def head_refusals(rank: int, world: int) -> Dict[str, Tuple[str, str]]:
    """The vocabulary-parallel tiled loss on ``lm_head`` layouts it cannot read its rows from: a bias set to a
    Replicate DTensor after ``ColwiseParallel`` laid the head out, a weight whose Shard(0) split is not
    ``torch.chunk``'s (``DTensor.from_local`` with uneven rows), and a ``sequence_group`` beside it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    head = _colwise_head(mesh, bias=True)
    whole_bias = head.bias.full_tensor().detach()
    head.bias = nn.Parameter(DTensor.from_local(whole_bias, mesh, [Replicate()], run_check=False))
    out["replicated_bias"] = _loss_outcome(head)
    head = _colwise_head(mesh)
    whole = head.weight.full_tensor().detach()
    cut = VOCAB // world + 4  # rank 0 holds 4 rows more than torch.chunk gives it, the last rank fewer
    rows = whole[:cut] if rank == 0 else whole[cut:]
    head.weight = nn.Parameter(DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=whole.shape,
                                                  stride=whole.stride()))
    out["uneven_rows"] = _loss_outcome(head)
    out["sequence_group"] = _loss_outcome(_colwise_head(mesh), sequence_group=dist.new_group())
    return out


def hf_head_unchecked_version(rank: int, world: int, path: str) -> Tuple[str, str]:
    """The tiled loss alone (``apply_tiled_loss``, no tiled MLP) on a model Hugging Face laid out (``tp_plan``)
    under a transformers version the seam was not checked on: the error of the first labelled forward."""
    from tiled_mlp.integrations import apply_tiled_loss
    from tiled_mlp.strategies import hf_tensor_parallel

    from .hf_tp_cases import BATCH, SEQUENCE, _load

    model = _load(path, tensor_parallel=True)
    ids = torch.zeros(BATCH, SEQUENCE, dtype=torch.long)
    with mock.patch.object(hf_tensor_parallel, "CHECKED_VERSIONS", ("0.0.0",)):
        apply_tiled_loss(model)
        return raised(lambda: model(input_ids=ids, labels=ids))
