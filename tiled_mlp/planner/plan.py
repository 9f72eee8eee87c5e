"""The plan: what one rank holds in one training step for each setting and sequence length, and the
longest sequence that fits a budget.

Depth: the step is modelled at the model's real depth, every decoder layer as it is built (MoE and
dense layers, ``first_k_dense_replace``, ``mlp_only_layers``), on the meta device. Extrapolating from
one and two layers is wrong twice over: the step's peak is the largest of several moments (the loss,
the end of the backward with every gradient alive) whose ranking changes with depth, and layers that
differ are not copies of the first. A full-depth step costs about a second (more with many tiled
shards), and the search (``search.py``) models only a few beyond the table's.

Per rank, on the device and on the host: under Ulysses SP (``Setting.sp``) the step modelled is one
rank's (``seq / sp`` tokens); the host holds what the backend keeps there (``backends.py``) and the
offloaded checkpoints at their most (modelled, ``Setting.offload_checkpoints``). A step fits when the
device holds it within ``budget`` and, where a ``host_budget`` is given, the host within that: checkpoint
offload trades one for the other, and at a node's millions of tokens the host can run out first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from tiled_mlp.core import auto_shards

from . import attention
from .attention_workspace import gpu_kernel
from .backends import OPTIMIZER, Backend, ParamSizes
from .compose import SHALLOW, compose, layers_alike
from .layers import decoder_layers, describe_kinds, param_sizes
from .pass_through import mlps_pass_through, untiled_twin
from .search import Longest, longest_fitting
from .step import Setting, build_model, step_sections, step_timeline
from .timeline import ACTIVATIONS, GENERATOR_STATES, GRADS, HOST, LOGITS, WEIGHTS, Timeline

IN_FLIGHT = "backend in flight"
OFFLOADED = "offloaded checkpoints"  # host memory: the layer inputs checkpoint offload moved there
__all__ = ["IN_FLIGHT", "OFFLOADED", "OPTIMIZER", "LOGITS_KNOB", "Point", "Planned", "Request", "Planner"]
# The knob is this library's own tiled loss, modelled as a setting (``step.py``), so the plan can show
# what it leaves rather than only name it.
LOGITS_KNOB = ("the tiled loss, which never holds the logits (the 'tiled-loss' settings, --tiled-loss; in training "
               "apply_tiled_mlp(model, loss=True) or apply_tiled_loss(model))")


GPU_SHARD_DEVICE = auto_shards.DeviceClass("cuda", (9, 0))  # H100, H200

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
    host_parts: Dict[str, float] = field(default_factory=dict)  # what the rank holds in host memory, by kind
    tokens_per_rank: int = 0  # seq / sp: what the rank's step runs (0: not said, seq)
    host_budget: Optional[float] = None  # the host memory the rank may use (None: not limited)

    @property
    def host_bytes(self) -> float:
        """Host memory of the rank at its most: the backend's (optimizer, ZeRO-3's offloaded partitions)
        and the step's own (the offloaded checkpoints and the generic path's generator states) at their
        peak. Held against ``host_budget`` where one is given."""
        return sum(self.host_parts.values())

    @property
    def host_fits(self) -> bool:
        return self.host_budget is None or self.host_bytes <= self.host_budget

    @property
    def device_fits(self) -> Optional[bool]:
        return None if self.budget is None else self.held_bytes <= self.budget

    def load(self) -> float:
        """The larger of the device's and the host's share of their budgets (1.0: full): what the
        search judges, so that the longest length fits both. Needs a device budget."""
        assert self.budget is not None, "a load needs a budget"
        device = self.held_bytes / self.budget
        return device if self.host_budget is None else max(device, self.host_bytes / self.host_budget)

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
        """Within the device budget and the host budget (None: no device budget to judge by)."""
        return None if self.budget is None else bool(self.device_fits) and self.host_fits

    @property
    def dominant(self) -> str:
        parts = self.held_parts
        return max(parts, key=lambda kind: parts[kind])

    def record(self) -> dict:
        return dict(seq=self.seq, setting=self.setting, tokens_per_rank=self.tokens_per_rank or self.seq,
                    peak_bytes=int(self.peak_bytes), optimizer_bytes=int(self.optimizer_bytes),
                    optimizer_on_device=self.optimizer_on_device, held_bytes=int(self.held_bytes), fits=self.fits,
                    dominant=self.dominant, parts={k: int(v) for k, v in self.held_parts.items()},
                    host_bytes=int(self.host_bytes), host_parts={k: int(v) for k, v in self.host_parts.items()},
                    host_budget=None if self.host_budget is None else int(self.host_budget), host_fits=self.host_fits,
                    device_fits=self.device_fits)


@dataclass
class Planned:
    """What planning one setting left in its planner: its points in the order they were modelled, its
    longest length, and whether its answer failed the full-depth check (it was then planned at full
    depth, its own steps)."""

    points: Dict[int, Point]
    longest: Longest
    full_depth_only: bool = False
    unshared: bool = False


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
    host_budget: Optional[float] = None  # per rank: a node's host memory over the ranks on it
    # The search stops at a million tokens a rank (under SP of N ranks, N million in all): a tiled step
    # there is thousands of shards to model, and the answer is then "at least" this, said so.
    seq_cap: int = 2**20
    # The longest lengths' points (each answer and one grid step more) modelled again at full depth where the
    # step is composed (``compose.py``), and checked equal; ALST's ladder, at millions of tokens, leaves it
    # to the tests that prove the composition.
    verify_full_depth: bool = True
    # The attention the step runs (``attention.CHOICES``); None: what transformers picks for the config.
    attention: Optional[str] = None
    # A GPU's step: each attention kernel's own workspace added where its backward runs
    # (``attention_workspace.py``). False: a CPU step's, byte for byte (the tests' real steps).
    gpu: bool = False


@dataclass
class Planner:
    request: Request
    on_point: Callable[[str], None] = lambda label: None
    _models: Dict[Setting, torch.nn.Module] = field(default_factory=dict)
    _points: Dict[Tuple[Setting, int], Point] = field(default_factory=dict)
    _sizes: Optional[ParamSizes] = None
    _shallow: Dict[Setting, Tuple[torch.nn.Module, torch.nn.Module]] = field(default_factory=dict)
    _composable: Optional[bool] = None
    _full_depth_only: Set[Setting] = field(default_factory=set)  # settings whose composed log failed its check
    # Whether each (tiled setting, length) passes every MLP through (``pass_through.py``); the settings
    # never shared with their twin (a shared answer failed its full-depth check).
    _passes: Dict[Tuple[Setting, int], bool] = field(default_factory=dict)
    _unshared: Set[Setting] = field(default_factory=set)
    # Points modelled for a twin's sake and not asked for themselves (kept out of ``modelled``), and the
    # full-depth records of the answers' checks, so that a step shared by two settings is modelled once.
    _twin_points: Dict[Tuple[Setting, int], Point] = field(default_factory=dict)
    _full_records: Dict[Tuple[Setting, int], dict] = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return self.request.config.get_text_config().num_hidden_layers

    def model(self, setting: Setting) -> torch.nn.Module:
        """The full-depth model under ``setting``, built once on the meta device."""
        if setting not in self._models:
            self._models[setting] = build_model(self.request.config, None, self.request.dtype, "meta", setting,
                                                batch=self.request.batch, attention_choice=self.request.attention)
        return self._models[setting]

    def _plain(self) -> torch.nn.Module:
        # Under tensor parallelism the rank's parameters are its TP shares (``tensor_parallel.py``): what the
        # backend then divides further and the optimizer keeps state for.
        tp = max((s.tp for s in self.request.settings), default=1)
        return self.model(Setting(tiled=False, checkpointing=False, tp=tp))

    def param_sizes(self) -> ParamSizes:
        if self._sizes is None:
            model = self._plain()
            self._sizes = param_sizes(model, decoder_layers(model, self.layers))
        return self._sizes

    def layer_kinds(self) -> str:
        """'' when the decoder layers are alike, else how many of each kind (``layers.py``)."""
        return describe_kinds(decoder_layers(self._plain(), self.layers))

    def composable(self, setting: Setting) -> bool:
        """Whether ``setting``'s step is put together from shallow ones (``compose.py``): the layers are
        alike and there are more than the shallow steps have."""
        if self._composable is None:
            plain = self._plain()
            self._composable = self.layers > SHALLOW + 1 and layers_alike(self.request.config,
                                                                          decoder_layers(plain, self.layers))
        return self._composable and setting not in self._full_depth_only

    def stepped(self, setting: Setting) -> List[torch.nn.Module]:
        """The models whose steps make ``setting``'s timelines: the shallow pair where it is composed,
        else the full-depth model (their modules keep what their last step did, e.g. a tiled MLP's path)."""
        if self.composable(setting) and setting in self._shallow:
            return list(self._shallow[setting])
        return [self.model(setting)]

    def stepped_first(self, setting: Setting) -> torch.nn.Module:
        """The model ``setting``'s modelled steps run first: the shallower of the pair where the step is
        composed, else the full-depth model. Every decoder layer runs the same code in both where the
        layers are alike."""
        return self.shallow_pair(setting)[0] if self.composable(setting) else self.model(setting)

    def shallow_pair(self, setting: Setting) -> Tuple[torch.nn.Module, torch.nn.Module]:
        """The ``SHALLOW``- and ``SHALLOW + 1``-layer models of ``setting``, built once."""
        if setting not in self._shallow:
            shallow, deeper = (build_model(self.request.config, depth, self.request.dtype, "meta", setting,
                                           batch=self.request.batch, attention_choice=self.request.attention)
                               for depth in (SHALLOW, SHALLOW + 1))
            self._shallow[setting] = (shallow, deeper)
        return self._shallow[setting]

    def pass_through_twin(self, setting: Setting, seq: int) -> Optional[Setting]:
        """The setting whose step ``setting``'s is at ``seq`` tokens (``pass_through.py``: every MLP of
        the tiled setting runs untiled there, by the auto policy's rule), else None."""
        twin = untiled_twin(setting)
        if twin is None or setting in self._unshared:
            return None
        key = (setting, seq)
        if key not in self._passes:
            # The layers are alike where the step is composed: the shallow model's MLPs are every layer's.
            model, depth = ((self.shallow_pair(setting)[0], SHALLOW) if self.composable(setting)
                            else (self.model(setting), self.layers))
            tokens = seq // setting.sp * self.request.batch
            hidden = self.request.config.get_text_config().hidden_size
            with auto_shards.modelled_as(self.shard_device()):
                self._passes[key] = mlps_pass_through(model, depth, tokens, hidden, self.request.dtype)
        return twin if self._passes[key] else None

    def timeline(self, setting: Setting, seq: int, describe: bool = False, full_depth: bool = False,
                 replay_shards: Optional[bool] = None) -> Timeline:
        """The full-depth step's timeline, of one rank: ``seq / sp`` tokens (not cached: the points are),
        composed from two shallow steps where the layers are alike (``compose.py``), else modelled at
        full depth, as it always is with ``full_depth``. ``describe``: with what made each allocation
        (``Timeline.at_peak``). ``replay_shards``: a full-depth step's same-size shards modelled once
        (``shard_replay.py``); by default only where the step is not asked at full depth."""
        if seq % setting.sp:
            raise ValueError(f"{seq} tokens do not split across {setting.sp} ranks of sequence parallelism; give a "
                             f"multiple of {setting.sp}")
        with attention.gpu_workspace(self.gpu_kernel()), auto_shards.modelled_as(self.shard_device()):
            return self._timeline(setting, seq, describe, full_depth, replay_shards)

    def shard_device(self) -> auto_shards.DeviceClass:
        """The device whose auto shard policy the step's tiled calls follow: a GPU plan's is a Hopper-class
        GPU's (the class docs/gpu.md measured), so modelled and real shard counts agree there; a CPU plan's
        is the modelled device (``auto_shards.modelled_as``; the CPU unless a caller says otherwise)."""
        return GPU_SHARD_DEVICE if self.request.gpu else auto_shards.MODELLED_DEVICE

    def gpu_kernel(self) -> Optional[str]:
        """The attention kernel whose workspace the step adds (None: a CPU step, or eager attention)."""
        req = self.request
        return gpu_kernel(req.attention or attention.default_for(req.config)[0]) if req.gpu else None

    def _timeline(self, setting: Setting, seq: int, describe: bool, full_depth: bool,
                  replay_shards: Optional[bool]) -> Timeline:
        twin = self.pass_through_twin(setting, seq)
        if twin is not None:
            return self._timeline(twin, seq, describe, full_depth, replay_shards)
        tokens, batch = seq // setting.sp, self.request.batch
        if not full_depth and self.composable(setting):
            shallow, deeper = (step_sections(m, tokens, batch, describe) for m in self.shallow_pair(setting))
            events = compose(shallow, deeper, self.layers)
            if events is not None:
                return Timeline(events, describe)
            self._full_depth_only.add(setting)
        return step_timeline(self.model(setting), tokens, batch, describe=describe,
                             replay_shards=not full_depth if replay_shards is None else replay_shards)

    def peak_allocations(self, setting: Setting, seq: int) -> Dict[str, float]:
        """What the rank's device holds at the step's peak at ``seq`` tokens, by what made it, largest
        first (weights and gradients at the rank's shares; the backend's in-flight buffers, analytic, are
        not among them)."""
        backend = self.request.backend
        timeline = self.timeline(setting, seq, describe=True)
        return timeline.at_peak(backend.weight_scale(), backend.grad_scale(not self.request.optimizer_on_device))

    def point_and_peak(self, setting: Setting, seq: int) -> Tuple[Point, Dict[str, float]]:
        """The point at ``seq`` and ``peak_allocations`` there, from one described step (the point is
        kept as ``point`` keeps it)."""
        backend = self.request.backend
        timeline = self.timeline(setting, seq, describe=True)
        key = (setting, seq)
        if key not in self._points:
            self._points[key] = self.point_of(setting, seq, timeline, backend)
            self.on_point(f"{setting.name} @ {seq}")
        peak = timeline.at_peak(backend.weight_scale(), backend.grad_scale(not self.request.optimizer_on_device))
        return self._points[key], peak

    def point(self, setting: Setting, seq: int) -> Point:
        key = (setting, seq)
        if key not in self._points:
            kept = self._twin_points.pop(key, None)
            self._points[key] = kept if kept is not None else self._modelled_point(setting, seq)
            self.on_point(f"{setting.name} @ {seq}")
        return self._points[key]

    def _modelled_point(self, setting: Setting, seq: int) -> Point:
        """``setting``'s point at ``seq``: its twin's, renamed, where the two share a step."""
        twin = self.pass_through_twin(setting, seq)
        if twin is None:
            return self.point_of(setting, seq, self.timeline(setting, seq), self.request.backend)
        key = (twin, seq)
        shared = self._points.get(key) or self._twin_points.get(key)
        if shared is None:
            shared = self._twin_points[key] = self._modelled_point(twin, seq)
        return replace(shared, setting=setting.name, parts=dict(shared.parts), host_parts=dict(shared.host_parts))

    def point_of(self, setting: Setting, seq: int, timeline: Timeline, backend: Backend) -> Point:
        """The point a rank of ``backend`` holds for a modelled step: its share of the weights and
        gradients at the moment that share makes the peak, the backend's buffers, the optimizer."""
        req = self.request
        on_host = not req.optimizer_on_device
        peak, (w, g, lg, a) = timeline.peak(backend.weight_scale(), backend.grad_scale(on_host))
        sizes = self.param_sizes()
        in_flight = backend.in_flight_bytes(sizes, req.dtype)
        parts = {WEIGHTS: w, GRADS: g, LOGITS: lg, ACTIVATIONS: a, IN_FLIGHT: in_flight}
        host = backend.host_parts(sizes, req.dtype, on_host)
        # The step's own host memory at its most, by what holds it; the generator states only where the
        # generic tiled path saved any (the fast path replays none).
        if setting.offload_checkpoints:
            host[OFFLOADED] = float(timeline.host_at_peak.get(HOST, 0))
        if timeline.host_at_peak.get(GENERATOR_STATES):
            host[GENERATOR_STATES] = float(timeline.host_at_peak[GENERATOR_STATES])
        return Point(seq, setting.name, peak + in_flight, backend.optimizer_bytes(sizes, req.dtype), parts,
                     req.budget, req.optimizer_on_device, host, seq // setting.sp, req.host_budget)

    def modelled(self) -> List[Point]:
        """Every point modelled so far (the table's and the search's)."""
        return list(self._points.values())

    def fits(self, setting: Setting, seq: int) -> bool:
        return bool(self.point(setting, seq).fits)

    def seq_step(self, setting: Setting) -> int:
        """The search's grid for ``setting``: ``seq_step``, made a multiple of the SP degree."""
        return math.lcm(self.request.seq_step, setting.sp)

    def seq_cap(self, setting: Setting) -> int:
        """Where the search stops for ``setting``: ``seq_cap`` tokens a rank."""
        return self.request.seq_cap * setting.sp

    def longest(self, setting: Setting) -> Longest:
        """The longest multiple of the grid (``seq_step``) up to the cap that fits the budget, and the
        host budget where one is given (the search judges ``Point.load``: both grow with the length)."""
        req = self.request
        if req.budget is None:
            raise ValueError("the longest sequence needs a budget")
        known = {seq: p.load() for (s, seq), p in self._points.items() if s == setting}
        found = longest_fitting(lambda seq: self.point(setting, seq).load(), 1.0, self.seq_step(setting),
                                self.seq_cap(setting), known)
        if req.verify_full_depth and self.composable(setting) and not self._full_depth_agrees(setting, found):
            # Never seen unless forced (``tests/planner/test_planner_side_by_side.py``); should it happen, the setting is
            # planned again at full depth, its own steps: the table's lengths first, as a plan models them.
            self._full_depth_only.add(setting)
            self._unshared.add(setting)
            for key in [key for key in self._points if key[0] == setting]:
                del self._points[key]
            for seq in req.seqs:
                self.point(setting, seq)
            return self.longest(setting)
        return found

    def _full_depth_agrees(self, setting: Setting, found: Longest) -> bool:
        """The answer's two points (the longest fitting, and one grid step more unless at the cap), modelled
        at full depth, equal the composed ones."""
        step = self.seq_step(setting)
        seqs = [seq for seq in (found.seq, None if found.at_cap else found.seq + step) if seq]
        return all(self._full_depth_record(setting, seq) == self.point(setting, seq).record() for seq in seqs)

    def _full_depth_record(self, setting: Setting, seq: int) -> dict:
        """The record of ``setting``'s point at ``seq`` from its step modelled at full depth (its twin's,
        renamed, where the two share a step)."""
        twin = self.pass_through_twin(setting, seq)
        if twin is not None:
            return {**self._full_depth_record(twin, seq), "setting": setting.name}
        key = (setting, seq)
        if key not in self._full_records:
            # What this checks is the composition: every layer stepped. Its shards are replayed as the
            # composed step's are (``shard_replay.py``, held equal to every shard run by
            # ``tests/planner/test_planner_shard_replay.py`` and ``test_planner_compose.py``), a third of
            # the cost of running them at an 8B answer's hundred-odd shards a layer.
            timeline = self.timeline(setting, seq, full_depth=True, replay_shards=True)
            self._full_records[key] = self.point_of(setting, seq, timeline, self.request.backend).record()
        return self._full_records[key]

    def planned(self, setting: Setting, found: Longest) -> Planned:
        """``setting``'s part of this plan, ``found`` its longest length (``longest``)."""
        return Planned({seq: p for (s, seq), p in self._points.items() if s == setting}, found,
                       setting in self._full_depth_only, setting in self._unshared)

    def adopt(self, planned: Dict[Setting, Planned]) -> None:
        """Settings planned apart (by forked copies of this planner, ``workers.py``) made this plan's, their
        points in the order one planner modelling them in turn keeps: the table's (``request.seqs``, by
        setting, in ``planned``'s order), then each setting's search."""
        points: Dict[Tuple[Setting, int], Point] = {}
        for seq in self.request.seqs:
            for setting, part in planned.items():
                points[(setting, seq)] = part.points[seq]
        for setting, part in planned.items():
            for seq, point in part.points.items():
                points.setdefault((setting, seq), point)
            if part.full_depth_only:
                self._full_depth_only.add(setting)
            if part.unshared:
                self._unshared.add(setting)
        self._points = points

    def max_seq(self, setting: Setting) -> int:
        return self.longest(setting).seq
