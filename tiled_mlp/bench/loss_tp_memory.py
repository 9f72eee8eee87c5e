"""Per-rank peak memory of the vocabulary-parallel tiled loss (``lm_head`` under ``ColwiseParallel``, each
of ``tp`` ranks holding ``vocab / tp`` rows), modelled in one process: fake tensors (shapes only) and
torch's fake process group (world size ``tp``, rank 0; every collective a no-op that keeps the shapes).

The peak is held to the rank's floor: x, dx, the rank's weight rows and their gradient, plus one shard's
working set (its float32 logits over the rank's columns and their float32 gradient); the target is at
most 1.1 times that.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tiled_mlp.core import tiled_cross_entropy
from tiled_mlp.core.loss_shards import LOSS_ELEMENT_BYTES, loss_num_shards
from tiled_mlp.core.shard_plan import make_shard_plan

from .loss_peak_tracker import LossPeakTracker

TARGET_RATIO = 1.1


def vocab_parallel_peak(tokens: int, hidden: int, vocab: int, tp: int, dtype: torch.dtype) -> Dict[str, Any]:
    """The modelled per-rank peak, the floor it is held to and their ratio (rank 0: the widest rows)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the tensor-parallel memory bench runs on its own fake process group: run it in a process "
                           "without one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,))
        with FakeTensorMode():
            head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
            parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
            x = torch.empty(1, tokens, hidden, dtype=dtype, requires_grad=True)
            labels = torch.zeros(1, tokens, dtype=torch.long)
            tracker = LossPeakTracker()
            tracker.name(x, "x")
            weight: Any = head.weight  # a DTensor, Shard(0)
            tracker.name(weight.to_local(), "W_local")
            tracker.name(labels, "labels")
            tracker.track(x, head.weight, labels)
            with tracker:
                tiled_cross_entropy(x, head, labels).backward()
            rows = weight.to_local().shape[0]
            if x.grad is None or head.weight.grad is None:
                raise RuntimeError("the step gave no dx or no dW")
    finally:
        dist.destroy_process_group()
    element = dtype.itemsize
    floor = 2 * tokens * hidden * element + 2 * rows * hidden * element
    shard_tokens = max(make_shard_plan(tokens, loss_num_shards(tokens, rows)).shard_sizes)
    shard_pair = 2 * shard_tokens * rows * LOSS_ELEMENT_BYTES
    reference = floor + shard_pair
    return dict(tokens=tokens, hidden=hidden, vocab=vocab, tp=tp, dtype=str(dtype).replace("torch.", ""),
                rows_per_rank=rows, peak_bytes=tracker.peak_bytes, floor_bytes=floor, shard_tokens=shard_tokens,
                shard_pair_bytes=shard_pair, reference_bytes=reference, ratio=tracker.peak_bytes / reference,
                target_ratio=TARGET_RATIO, met=tracker.peak_bytes <= TARGET_RATIO * reference,
                largest_at_peak=[dict(what=w, bytes=b, count=n) for w, b, n in tracker.largest_at_peak()],
                answered=tracker.answered)


def format_tp_report(result: Dict[str, Any]) -> str:
    gib = 2**30
    lines = [
        f"vocabulary-parallel tiled loss, per rank: {result['tokens']} tokens x hidden {result['hidden']} x vocab "
        f"{result['vocab']}, TP={result['tp']} ({result['rows_per_rank']} rows a rank), {result['dtype']}",
        f"  peak {result['peak_bytes'] / gib:.3f} GiB; x + dx + W_local + dW_local {result['floor_bytes'] / gib:.3f} GiB "
        f"+ one shard's fp32 logits and gradient ({result['shard_tokens']} tokens) {result['shard_pair_bytes'] / gib:.3f} GiB "
        f"= {result['reference_bytes'] / gib:.3f} GiB",
        f"  ratio {result['ratio']:.3f} (target <= {result['target_ratio']}): {'met' if result['met'] else 'MISSED'}",
        "  largest at the peak: " + ", ".join(f"{e['what']} {e['bytes'] / gib:.3f} GiB x{e['count']}"
                                               for e in result["largest_at_peak"]),
    ]
    return "\n".join(lines)
