"""The plan: peak memory per rank of one training step for each setting and sequence length, and the
longest sequence that fits a budget, found by bisection on the modelled step.

Depth: the decoder layers of a model are identical, so a step's memory is affine in their number
(each layer adds its weights, gradients and saved activations; the peak falls at the same point of
the step). The planner models the step at 1 and 2 layers and takes the difference as one layer: a
million-token step of a 32-layer model then costs three layers of modelling, not 32. Tests check the
affinity against deeper builds and against the real full-depth step (``tests/test_planner.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .backends import Backend, ParamSizes
from .step import Setting, build_model, step_timeline
from .timeline import ACTIVATIONS, GRADS, LOGITS, WEIGHTS

DEPTHS = (1, 2)
IN_FLIGHT = "backend in flight"
LOGITS_KNOB = ("a loss computed in chunks that never holds the logits (Liger-Kernel's fused linear "
               "cross-entropy, liger_kernel.transformers.apply_liger_kernel_to_<model>(fused_linear_cross_entropy=True))")


@dataclass
class Point:
    """One (setting, sequence length) of the plan, per rank."""

    seq: int
    setting: str
    peak_bytes: float  # weights, gradients and activations of the step, plus the backend's in-flight buffers
    optimizer_bytes: float  # analytic (``backends.py``)
    parts: Dict[str, float]  # peak_bytes by kind, at the peak
    budget: Optional[float] = None
    optimizer_on_device: bool = True  # False: offloaded to the host, not held against the budget

    @property
    def held_bytes(self) -> float:
        """What the rank's device holds at the peak: the step's peak and the optimizer state on it."""
        return self.peak_bytes + (self.optimizer_bytes if self.optimizer_on_device else 0)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.budget is None else self.held_bytes <= self.budget

    @property
    def dominant(self) -> str:
        return max(self.parts, key=lambda kind: self.parts[kind])

    def record(self) -> dict:
        return dict(seq=self.seq, setting=self.setting, peak_bytes=int(self.peak_bytes),
                    optimizer_bytes=int(self.optimizer_bytes), fits=self.fits, dominant=self.dominant,
                    parts={k: int(v) for k, v in self.parts.items()})


@dataclass
class Request:
    config: Any  # a transformers PretrainedConfig
    seqs: List[int]
    settings: List[Setting]
    backend: Backend
    batch: int = 1
    dtype: torch.dtype = torch.bfloat16
    budget: Optional[float] = None
    optimizer_on_device: bool = True
    seq_step: int = 1024
    seq_cap: int = 2**24


@dataclass
class Planner:
    request: Request
    on_point: Callable[[str], None] = lambda label: None
    _models: Dict[Tuple[Setting, int], torch.nn.Module] = field(default_factory=dict)
    _points: Dict[Tuple[Setting, int], Point] = field(default_factory=dict)
    _sizes: Optional[ParamSizes] = None

    @property
    def layers(self) -> int:
        return self.request.config.get_text_config().num_hidden_layers

    def _model(self, setting: Setting, depth: int) -> torch.nn.Module:
        key = (setting, depth)
        if key not in self._models:
            self._models[key] = build_model(self.request.config, depth, self.request.dtype, "meta", setting)
        return self._models[key]

    def _extrapolate(self, at_depths: Sequence[float]) -> float:
        one, two = at_depths
        return one + (self.layers - 1) * (two - one)

    def param_sizes(self) -> ParamSizes:
        if self._sizes is None:
            plain = Setting(tiled=False, checkpointing=False)
            counts = [sum(p.numel() for p in self._model(plain, d).parameters()) for d in DEPTHS]
            per_layer = counts[1] - counts[0]
            largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in self._model(plain, 1).modules())
            self._sizes = ParamSizes(total=int(self._extrapolate(counts)), per_layer=per_layer,
                                     root=counts[0] - per_layer, largest_module=largest)
        return self._sizes

    def point(self, setting: Setting, seq: int) -> Point:
        key = (setting, seq)
        if key not in self._points:
            self._points[key] = self._model_point(setting, seq)
            self.on_point(f"{setting.name} @ {seq}")
        return self._points[key]

    def _model_point(self, setting: Setting, seq: int) -> Point:
        req = self.request
        scale = req.backend.weight_scale()
        peaks, parts = [], []
        for depth in DEPTHS:
            peak, (w, g, lg, a) = step_timeline(self._model(setting, depth), seq, req.batch).peak(scale, scale)
            peaks.append(peak)
            parts.append({WEIGHTS: w, GRADS: g, LOGITS: lg, ACTIVATIONS: a})
        sizes = self.param_sizes()
        in_flight = req.backend.in_flight_bytes(sizes, req.dtype)
        at_depth = {kind: self._extrapolate([parts[0][kind], parts[1][kind]]) for kind in parts[0]}
        at_depth[IN_FLIGHT] = in_flight
        return Point(seq, setting.name, self._extrapolate(peaks) + in_flight,
                     req.backend.optimizer_bytes(sizes, req.dtype), at_depth, req.budget, req.optimizer_on_device)

    def modelled(self) -> List[Point]:
        """Every point modelled so far (the table's and the bisection's)."""
        return list(self._points.values())

    def fits(self, setting: Setting, seq: int) -> bool:
        return bool(self.point(setting, seq).fits)

    def max_seq(self, setting: Setting) -> int:
        """The longest multiple of ``seq_step`` that fits the budget (0: not even one step), by
        doubling until a length does not fit, then bisection between the last two."""
        step, cap = self.request.seq_step, self.request.seq_cap
        if not self.fits(setting, step):
            return 0
        low = step
        while low * 2 <= cap and self.fits(setting, low * 2):
            low *= 2
        high = low * 2
        if high > cap:
            return low
        while high - low > step:
            middle = (low + high) // 2 // step * step
            if self.fits(setting, middle):
                low = middle
            else:
                high = middle
        return low
