"""The planner's tensor-parallel step (``tiled-mlp plan --tp N``) against a real one: two gloo ranks on the CPU,
each running a 3-layer Llama (float32) with torchtitan's TP plan put on it by ``parallelize_module`` over a real
device mesh (and in one setting the library's tiling put on after it: tiled MLPs, the vocabulary-parallel tiled
loss, tiled norms), every allocation of each rank's step tracked. The planner's modelled step of one rank (the meta
device, the same plan over a fake process group, ``tiled_mlp/planner/tensor_parallel.py``) must equal each
rank's, to the byte, after every allocation: weights, gradients, logits and other activations apart.

Gloo's worker thread keeps each collective's tensors until it drops the finished work, a moment that races with
the step: seen, one layer's all-reduced attention output freed one allocation later than the step drops it, on one
rank, in one run and not in the next (and the tiled loss's per-shard row sums, reduced in place by
``dist.all_reduce``, freed after the backward's first allocation). So the real step's all-reduces (DTensor's and
the untiled vocabulary-parallel loss's ``funcol.all_reduce``, the tiled loss's ``dist.all_reduce``) allocate their
output where the tracker sees it, or reduce in place, and hand gloo a private copy made outside the tracker
(``_private_tp_collectives``): the step's own tensors are then freed where the step's code
drops them, which is what the model says, and what is checked.
"""
from __future__ import annotations

import pytest
import torch

from .spawn import run_distributed
from .tiny_models import planner_llama  # 4 query heads, 2 key/value heads: 2 and 1 on each of 2 ranks

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

TP, SEQ = 2, 256
# The plain step, with every decoder layer checkpointed, and the library's tiling put on the TP plan: tiled MLPs
# (the fast kernel's local view of the TP Linears), the vocabulary-parallel tiled loss and tiled norms, checkpointed.
SETTINGS = [dict(tiled=False, checkpointing=False), dict(tiled=False, checkpointing=True),
            dict(tiled=True, num_shards=4, tiled_loss=True, loss_num_shards=4, tiled_norms=True, checkpointing=True)]


def _private_tp_collectives() -> None:
    """``funcol.all_reduce`` with its output allocated under the tracker, and ``dist.all_reduce`` (in place: the
    vocabulary-parallel tiled loss's row maxima and sums, and its input gradient) reducing into its own tensor,
    each with gloo given a copy the tracker never sees."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._python_dispatch import _disable_current_modes

    gloo_all_reduce = dist.all_reduce

    def all_reduce(tensor, reduceOp, group, tag=""):
        output = torch.empty_like(tensor)  # the functional all-reduce's output, as its kernel allocates it
        with _disable_current_modes():
            received = tensor.clone()
            gloo_all_reduce(received, getattr(dist.ReduceOp, reduceOp.upper()),
                            group=_resolve_process_group(funcol._resolve_group_name(group, tag)))
            output.copy_(received)
        return funcol._maybe_wrap_tensor(output)

    def all_reduce_in_place(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        assert not async_op, "the steps checked here reduce synchronously"
        with _disable_current_modes():
            received = tensor.clone()
            gloo_all_reduce(received, op, group=group)
            tensor.copy_(received)

    funcol.all_reduce = all_reduce
    dist.all_reduce = all_reduce_in_place


def _real_tp_steps(rank: int, world_size: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    from tiled_mlp.planner.step import Setting, build_model, step_timeline

    _private_tp_collectives()
    mesh = init_device_mesh("cpu", (world_size,))
    out = []
    for kwargs in SETTINGS:
        model = build_model(planner_llama(), None, torch.float32, "cpu", Setting(tp=TP, **kwargs), tp_mesh=mesh)
        # The ranks of a TP group run the same tokens: both take rank 0's.
        points = step_timeline(model, SEQ, 1, rank=0).points
        out.append((points, [getattr(getattr(layer.mlp, "tiling", None), "last_path", None)
                             for layer in model.model.layers]))
    return out


@pytest.mark.timeout(180)
def test_a_real_two_rank_tensor_parallel_step_is_predicted_to_the_byte(tmp_path):
    from tiled_mlp.planner.backends import Backend
    from tiled_mlp.planner.plan import Planner, Request
    from tiled_mlp.planner.step import Setting

    measured = run_distributed(_real_tp_steps, TP, tmp_path, timeout=120)
    for index, kwargs in enumerate(SETTINGS):
        setting = Setting(tp=TP, **kwargs)
        planner = Planner(Request(planner_llama(), [SEQ], [setting], Backend("single", 1), dtype=torch.float32))
        predicted = planner.timeline(setting, SEQ)
        for rank, steps in enumerate(measured):
            points, paths = steps[index]
            # A tiled MLP ran the fast kernel on the rank's local weights ("auto" proves it for this MLP; it is what the planner models).
            assert paths == (["fast"] * 3 if kwargs["tiled"] else [None] * 3), paths
            first = next((i for i, (p, m) in enumerate(zip(predicted.points, points, strict=False)) if p != m), None)
            assert first is None and len(predicted.points) == len(points), (
                f"{setting.name}, rank {rank}: allocation {first}: predicted "
                f"{predicted.points[first] if first is not None else len(predicted.points)}, measured "
                f"{points[first] if first is not None else len(points)}")
        # The rank holds half of each sharded weight: the projections and the LM head, not the embeddings or norms.
        weights = max(p[0] for p in predicted.points)
        config = planner_llama()
        hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
        kv = hidden // config.num_attention_heads * config.num_key_value_heads
        sharded = 3 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter) + vocab * hidden
        whole = vocab * hidden + (2 * 3 + 1) * hidden
        assert weights == 4 * (sharded // TP + whole)
