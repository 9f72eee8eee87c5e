"""The planner's Ulysses SP step (``tiled-mlp plan --sp N``) against a real one: two gloo ranks on the CPU,
each running a 3-layer Llama (float32) with DeepSpeed's ``UlyssesSPAttentionHF`` around the planner's
causal attention on a real process group, every allocation of each rank's step tracked. The planner's
modelled step of one rank (the meta device, DeepSpeed's class on the planner's stand-in group,
``tiled_mlp/planner/sequence_parallel.py``) must equal each rank's, to the byte, after every allocation:
device bytes by kind and host bytes (checkpoint offload on).

Gloo's worker thread keeps each collective's tensors until it drops the finished work, a moment that races
with the step: seen, the all-to-all input of one layer's keys freed one allocation later than the step
drops it, on both ranks, in one run and not in another. So the real step hands gloo private copies of
its tensors, made outside the tracker (``_private_sp_collectives``): the step's own tensors are then freed
where the step's code drops them, which is what the model says, and what is checked.
"""
from __future__ import annotations

import pytest
import torch

from .spawn import run_distributed
from .tiny_models import planner_llama  # 4 query heads, 2 key/value heads: 2 and 1 on each of 2 ranks

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

SP, SEQ = 2, 1024  # 512 tokens a rank
# The plain step, and everything at once (tiled MLPs and loss, checkpointing, checkpoint offload).
SETTINGS = [dict(tiled=False, checkpointing=False),
            dict(tiled=True, checkpointing=True, num_shards=4, tiled_loss=True, loss_num_shards=4,
                 offload_checkpoints=True)]


def _private_sp_collectives() -> None:
    """torch.distributed's all-to-all and all-gather, on copies the memory tracker never sees."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import _disable_current_modes

    all_to_all, all_gather = dist.all_to_all_single, dist.all_gather

    def all_to_all_single(output, input, *args, **kwargs):
        with _disable_current_modes():
            received = torch.empty_like(output)
            work = all_to_all(received, input.clone(), *args, **kwargs)
            output.copy_(received)
        return work

    def all_gather_list(tensor_list, tensor, *args, **kwargs):
        with _disable_current_modes():
            received = [torch.empty_like(t) for t in tensor_list]
            work = all_gather(received, tensor.clone(), *args, **kwargs)
            for into, value in zip(tensor_list, received, strict=True):
                into.copy_(value)
        return work

    dist.all_to_all_single, dist.all_gather = all_to_all_single, all_gather_list


def _real_sp_steps(rank: int, world_size: int) -> list:
    import deepspeed
    import torch.distributed as dist

    from tiled_mlp.planner.step import Setting, build_model, step_timeline

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    _private_sp_collectives()
    group = dist.new_group(list(range(world_size)))
    out = []
    for kwargs in SETTINGS:
        setting = Setting(sp=SP, **kwargs)
        model = build_model(planner_llama(), None, torch.float32, "cpu", setting, sp_group=group)
        timeline = step_timeline(model, SEQ // SP, 1, rank=rank)
        out.append((timeline.points, timeline.host))
    return out


@pytest.mark.timeout(180)
def test_a_real_two_rank_ulysses_step_is_predicted_to_the_byte(tmp_path):
    from tiled_mlp.planner.backends import Backend
    from tiled_mlp.planner.plan import Planner, Request
    from tiled_mlp.planner.step import Setting

    measured = run_distributed(_real_sp_steps, SP, tmp_path, timeout=120)
    for index, kwargs in enumerate(SETTINGS):
        setting = Setting(sp=SP, **kwargs)
        planner = Planner(Request(planner_llama(), [SEQ], [setting], Backend("zero3", SP), dtype=torch.float32))
        predicted = planner.timeline(setting, SEQ)
        assert planner.point(setting, SEQ).tokens_per_rank == SEQ // SP
        for rank, steps in enumerate(measured):
            points, host = steps[index]
            first = next((i for i, (p, m) in enumerate(zip(predicted.points, points, strict=False)) if p != m), None)
            assert first is None and len(predicted.points) == len(points), (
                f"{setting.name}, rank {rank}: allocation {first}: predicted "
                f"{predicted.points[first] if first is not None else len(predicted.points)}, measured "
                f"{points[first] if first is not None else len(points)}")
            assert predicted.host == host, f"{setting.name}, rank {rank}: host bytes differ"
        if setting.offload_checkpoints:
            # The inputs of 2 of the 3 layers (the last keeps its own) of the rank's 512 tokens, float32.
            assert predicted.host_peak() == 2 * (SEQ // SP) * 64 * 4
