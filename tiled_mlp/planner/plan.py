"""The plan: what one rank holds in one training step for each setting and sequence length, and the
longest sequence that fits a budget.

Depth: the step is modelled at the model's real depth, every decoder layer as it is built (MoE and
dense layers, ``first_k_dense_replace``, ``mlp_only_layers``), on the meta device. Extrapolating from
one and two layers is wrong twice over: the step's peak is the largest of several moments (the loss,
the end of the backward with every gradient alive) whose ranking changes with depth, and layers that
differ are not copies of the first. A full-depth step costs about a second (more with many tiled
shards), and the search (``search.py``) models only a few beyond the table's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .backends import Backend, ParamSizes
from .layers import decoder_layers, describe_kinds, param_sizes
from .search import Longest, longest_fitting
from .step import Setting, build_model, step_timeline
from .timeline import ACTIVATIONS, GRADS, LOGITS, WEIGHTS, Timeline

IN_FLIGHT = "backend in flight"
OPTIMIZER = "optimizer"
# The knob is this library's own tiled loss, modelled as a setting (``step.py``), so the plan can show
# what it leaves rather than only name it.
LOGITS_KNOB = ("the tiled loss, which never holds the logits (the 'tiled-loss' settings, --tiled-loss; in training "
               "apply_tiled_mlp(model, loss=True) or apply_tiled_loss(model))")


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
        """What the rank's device holds at the peak, the total ``fits`` judges: the step's peak and the
        optimizer state when it is on the device."""
        return self.peak_bytes + (self.optimizer_bytes if self.optimizer_on_device else 0)

    @property
    def held_parts(self) -> Dict[str, float]:
        """``held_bytes`` by kind."""
        return {**self.parts, **({OPTIMIZER: self.optimizer_bytes} if self.optimizer_on_device else {})}

    @property
    def fits(self) -> Optional[bool]:
        return None if self.budget is None else self.held_bytes <= self.budget

    @property
    def dominant(self) -> str:
        parts = self.held_parts
        return max(parts, key=lambda kind: parts[kind])

    def record(self) -> dict:
        return dict(seq=self.seq, setting=self.setting, peak_bytes=int(self.peak_bytes),
                    optimizer_bytes=int(self.optimizer_bytes), optimizer_on_device=self.optimizer_on_device,
                    held_bytes=int(self.held_bytes), fits=self.fits, dominant=self.dominant,
                    parts={k: int(v) for k, v in self.held_parts.items()})


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
    # The search stops at a million tokens: a tiled step there is thousands of shards to model, and
    # the answer is then "at least" this, said so.
    seq_cap: int = 2**20


@dataclass
class Planner:
    request: Request
    on_point: Callable[[str], None] = lambda label: None
    _models: Dict[Setting, torch.nn.Module] = field(default_factory=dict)
    _points: Dict[Tuple[Setting, int], Point] = field(default_factory=dict)
    _sizes: Optional[ParamSizes] = None

    @property
    def layers(self) -> int:
        return self.request.config.get_text_config().num_hidden_layers

    def model(self, setting: Setting) -> torch.nn.Module:
        """The full-depth model under ``setting``, built once on the meta device."""
        if setting not in self._models:
            self._models[setting] = build_model(self.request.config, None, self.request.dtype, "meta", setting)
        return self._models[setting]

    def _plain(self) -> torch.nn.Module:
        return self.model(Setting(tiled=False, checkpointing=False))

    def param_sizes(self) -> ParamSizes:
        if self._sizes is None:
            model = self._plain()
            self._sizes = param_sizes(model, decoder_layers(model, self.layers))
        return self._sizes

    def layer_kinds(self) -> str:
        """'' when the decoder layers are alike, else how many of each kind (``layers.py``)."""
        return describe_kinds(decoder_layers(self._plain(), self.layers))

    def timeline(self, setting: Setting, seq: int) -> Timeline:
        """The full-depth step's timeline (not cached: the points are)."""
        return step_timeline(self.model(setting), seq, self.request.batch)

    def point(self, setting: Setting, seq: int) -> Point:
        key = (setting, seq)
        if key not in self._points:
            self._points[key] = self.point_of(setting, seq, self.timeline(setting, seq), self.request.backend)
            self.on_point(f"{setting.name} @ {seq}")
        return self._points[key]

    def point_of(self, setting: Setting, seq: int, timeline: Timeline, backend: Backend) -> Point:
        """The point a rank of ``backend`` holds for a modelled step: its share of the weights and
        gradients at the moment that share makes the peak, the backend's buffers, the optimizer."""
        req = self.request
        scale = backend.weight_scale()
        peak, (w, g, lg, a) = timeline.peak(scale, scale)
        sizes = self.param_sizes()
        in_flight = backend.in_flight_bytes(sizes, req.dtype)
        parts = {WEIGHTS: w, GRADS: g, LOGITS: lg, ACTIVATIONS: a, IN_FLIGHT: in_flight}
        return Point(seq, setting.name, peak + in_flight, backend.optimizer_bytes(sizes, req.dtype), parts,
                     req.budget, req.optimizer_on_device)

    def modelled(self) -> List[Point]:
        """Every point modelled so far (the table's and the search's)."""
        return list(self._points.values())

    def fits(self, setting: Setting, seq: int) -> bool:
        return bool(self.point(setting, seq).fits)

    def longest(self, setting: Setting) -> Longest:
        """The longest multiple of ``seq_step`` up to ``seq_cap`` that fits the budget."""
        req = self.request
        if req.budget is None:
            raise ValueError("the longest sequence needs a budget")
        known = {seq: p.held_bytes for (s, seq), p in self._points.items() if s == setting}
        return longest_fitting(lambda seq: self.point(setting, seq).held_bytes, req.budget, req.seq_step,
                               req.seq_cap, known)

    def max_seq(self, setting: Setting) -> int:
        return self.longest(setting).seq
