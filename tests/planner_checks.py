"""The planner's honesty check, shared by its test files: a real float32 step on the CPU and the
planner's meta step of the same setting, equal after every allocation (weights, gradients, logits,
activations) and in host memory."""
from __future__ import annotations

from typing import Any, Tuple

import torch

from tiled_mlp.planner.backends import Backend
from tiled_mlp.planner.plan import Planner, Request
from tiled_mlp.planner.step import Setting, build_model, step_timeline
from tiled_mlp.planner.timeline import Timeline


def predicted_to_the_byte(setting: Setting, config: Any, seq: int) -> Tuple[Planner, torch.nn.Module, Timeline]:
    """Asserts the two steps equal; returns the planner, the real model and its measured timeline."""
    planner = Planner(Request(config, [seq], [setting], Backend("single", 1), dtype=torch.float32))
    real = build_model(config, None, torch.float32, "cpu", setting)
    measured = step_timeline(real, seq, 1)
    predicted = planner.timeline(setting, seq)
    first = next((i for i, (p, m) in enumerate(zip(predicted.points, measured.points, strict=False)) if p != m), None)
    assert first is None and len(predicted.points) == len(measured.points), f"allocation {first} differs"
    assert predicted.host == measured.host
    return planner, real, measured
