"""Fast per-shard kernel for gated MLPs: ``y = down(act(gate(x)) * up(x))``.

Backward recomputes only gate and up (2 matmul units) and never down_proj's forward:
    h  = act(g) * u            dWd += dy^T h          dh = dy Wd
    du = dh * act(g)           dg  = dh * u * act'(g)
    dWg += dg^T x   dWu += du^T x   dx = dg Wg + du Wu
so a step costs 11 matmul units against 9 untiled, where a full recompute costs 12.
Weight gradients go straight into one buffer per weight (``addmm_``) and elementwise work is done in
place, so a shard's working set is about four ``[shard_tokens, intermediate]`` buffers at its peak.

A form with fixed factors (FalconH1: ``down(up(x) * act(gate(x) * gs)) * ds``) scales g and u in place
after their projections and the output after down; backward scales dy by ``ds`` and dg, du by
``gs``, ``us`` (the chain rule through each product with a constant).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .base import ShardKernel

if TYPE_CHECKING:
    from ..gated_spec import GatedMLPSpec
    from ..sharded_autograd import GradAccumulator

# -- the gated activations ---------------------------------------------------------------------------------------
# ``forward_mul(g, u)`` returns ``act(g) * u``; ``backward_mul(dh, g, u)`` returns ``(dg, du)`` and may overwrite
# ``g``, ``u`` and ``dh`` (a shard's working set stays a few ``[tokens, intermediate]`` buffers). The native ones
# use aten's fused ``*_backward`` ops (CPU, CUDA, Ascend NPU alike); a faster kernel for a device type (a Triton
# kernel) is registered by whoever knows its library (``register_fused_kernel``) and used where the call allows.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


class NativeGatedActivation:
    """Pure-torch kernels (every device type)."""

    def __init__(self, name: str):
        if name not in ACTIVATIONS:
            raise ValueError(f"unknown gated activation {name!r}; known: {', '.join(ACTIVATIONS)}")
        self.name = name

    def act(self, g: torch.Tensor) -> torch.Tensor:
        if self.name == "silu":
            return F.silu(g)
        return F.gelu(g, approximate="tanh" if self.name == "gelu_tanh" else "none")

    def act_backward(self, grad: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = grad * act'(g)``; ``out`` may be ``g`` itself (same-index elementwise aliasing)."""
        if self.name == "silu":
            return torch.ops.aten.silu_backward.grad_input(grad, g, grad_input=out)
        approximate = "tanh" if self.name == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_backward.grad_input(grad, g, approximate=approximate, grad_input=out)

    def forward_mul(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.act(g).mul_(u)

    def backward_mul(self, dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        du = self.act(g).mul_(dh)  # du = dh * act(g)
        dh.mul_(u)  # dh * u: the upstream gradient of act(g)
        dg = self.act_backward(dh, g, out=g)
        return dg, du


@dataclass(frozen=True)
class FusedKernel:
    """A faster kernel for some activations on one device type: ``factory(name)`` builds it, when
    ``available()`` (its library is installed)."""

    device_type: str
    names: FrozenSet[str]
    factory: Callable[[str], Any]
    available: Callable[[], bool]


# Registered fused kernels (``register_fused_kernel``); the last registered for a device and name wins.
_FUSED: List[FusedKernel] = []
_FUSED_GENERATION = [0]


def register_fused_kernel(device_type: str, names: Iterable[str], factory: Callable[[str], Any],
                          available: Callable[[], bool] = lambda: True) -> FusedKernel:
    """Use ``factory(name)`` (an object with ``forward_mul`` and ``backward_mul`` as
    ``NativeGatedActivation``'s) for the activations ``names`` on tensors of ``device_type``, whenever
    ``available()``; each call that takes the gated fast kernel with fused kernels allowed asks."""
    names = frozenset(names)
    unknown = sorted(names - set(ACTIVATIONS))
    if unknown or not names:
        raise ValueError(f"a fused kernel computes some of {', '.join(ACTIVATIONS)}; got {sorted(names)}")
    if not isinstance(device_type, str) or not callable(factory) or not callable(available):
        raise TypeError("register_fused_kernel takes a device type name, the activation names, a factory and "
                        "an availability check")
    kernel = FusedKernel(device_type, names, factory, available)
    _FUSED.append(kernel)
    _FUSED_GENERATION[0] += 1
    return kernel


def unregister_fused_kernel(kernel: FusedKernel) -> None:
    """Withdraw what ``register_fused_kernel`` returned."""
    _FUSED[:] = [k for k in _FUSED if k is not kernel]
    _FUSED_GENERATION[0] += 1


def gated_activation(name: str, device: torch.device, use_fused: bool = True):
    """The kernel for ``name`` on ``device``: the last fused kernel registered for it and available,
    when ``use_fused``, else the native one."""
    if use_fused:
        for kernel in reversed(_FUSED):
            if kernel.device_type == device.type and name in kernel.names and kernel.available():
                return kernel.factory(name)
    return NativeGatedActivation(name)


# -- the kernel ----------------------------------------------------------------------------------------------------

ROLES = ("gate", "up", "gate_up", "down")
# Where the down projection's weight index sits in ``GatedLayout.as_args``' ints (two per role, weight first).
DOWN_WEIGHT_ARG = 2 * ROLES.index("down")


@dataclass(frozen=True)
class Slots:
    """Where one projection's weight and bias sit in the kernel's tensors."""

    weight: int
    bias: Optional[int]

    def of(self, tensors: Sequence[torch.Tensor]):
        return tensors[self.weight], None if self.bias is None else tensors[self.bias]


@dataclass(frozen=True)
class GatedLayout:
    """Everything the gated kernel needs besides its tensors and activation: where each projection's
    weight and bias sit among the tensors (by role: gate and up, or the fused gate_up, then down) and the
    form's fixed factors. Plain ints and floats (``as_args``), so that a custom op carries it as arguments
    (``ops/gated_mlp.py``) and rebuilds it (``from_args``)."""

    slots: Tuple[Tuple[str, Slots], ...]
    gate_scale: float = 1.0
    up_scale: float = 1.0
    down_scale: float = 1.0

    @classmethod
    def of(cls, spec: GatedMLPSpec) -> GatedLayout:
        index = {id(p): i for i, p in enumerate(spec.params)}
        roles = {"gate": spec.gate, "up": spec.up, "gate_up": spec.gate_up, "down": spec.down}
        slots = tuple((role, Slots(index[id(linear.weight)], None if linear.bias is None else index[id(linear.bias)]))
                      for role, linear in roles.items() if linear is not None)
        return cls(slots, spec.gate_scale, spec.up_scale, spec.down_scale)

    def as_args(self) -> Tuple[List[int], List[float]]:
        """Two ints per role in ``ROLES`` order (weight index, bias index; -1 where absent), and the factors."""
        by_role = dict(self.slots)
        flat: List[int] = []
        for role in ROLES:
            slot = by_role.get(role)
            flat += [-1, -1] if slot is None else [slot.weight, -1 if slot.bias is None else slot.bias]
        return flat, [self.gate_scale, self.up_scale, self.down_scale]

    @classmethod
    def from_args(cls, flat: Sequence[int], scales: Sequence[float]) -> GatedLayout:
        if len(flat) != 2 * len(ROLES) or len(scales) != 3:
            raise ValueError(f"a gated layout is {2 * len(ROLES)} slot indices and 3 factors, got {list(flat)}, {list(scales)}")
        slots = tuple((role, Slots(flat[2 * i], None if flat[2 * i + 1] < 0 else flat[2 * i + 1]))
                      for i, role in enumerate(ROLES) if flat[2 * i] >= 0)
        roles = {role for role, _ in slots}
        if "down" not in roles or not ({"gate", "up"} <= roles) ^ ("gate_up" in roles):
            raise ValueError(f"a gated layout holds down and either gate and up or gate_up, got roles {sorted(roles)}")
        return cls(slots, *(float(s) for s in scales))


class GatedShardKernel(ShardKernel):
    """The formula computed directly; the forward's code and structure proved that it reads nothing but the
    input and ``params`` and draws no random numbers."""

    name = "fast"
    replays_rng = False
    # Plain tensors only: distributed parameters reach it through the strategy's local view (``tiled_call``).
    runs_on_local_view = True
    serves_many_calls = True  # stateless: built once per call plan

    def __init__(self, layout: GatedLayout, activation, params: List[torch.Tensor], module_name: str = "the gated MLP"):
        self.module_name = module_name
        self.activation = activation
        self.params = params
        self.owned_params = params  # the structure proved the module owns nothing else
        self.layout = layout
        self._slots = dict(layout.slots)
        self._fused = "gate_up" in self._slots
        self._gate_scale, self._up_scale, self._down_scale = layout.gate_scale, layout.up_scale, layout.down_scale

    @classmethod
    def for_spec(cls, spec: GatedMLPSpec, activation, module_name: str = "the gated MLP") -> GatedShardKernel:
        return cls(GatedLayout.of(spec), activation, spec.params, module_name)

    def output_width(self, tensors: Sequence[torch.Tensor]) -> int:
        """The down projection's rows (the output is written with ``out=``, in the input's dtype)."""
        return tensors[self._slots["down"].weight].shape[0]

    # -- projections -------------------------------------------------------------------------------
    def _gate_up(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]):
        """(g, u, gu): gu is the fused [g | u] buffer when the weights are fused, else None."""
        if self._fused:
            gu = F.linear(x, *self._slots["gate_up"].of(tensors))
            g, u = gu.chunk(2, dim=-1)
        else:
            g, u, gu = F.linear(x, *self._slots["gate"].of(tensors)), F.linear(x, *self._slots["up"].of(tensors)), None
        if self._gate_scale != 1.0:
            g.mul_(self._gate_scale)
        if self._up_scale != 1.0:
            u.mul_(self._up_scale)
        return g, u, gu

    def _add_weight_grads(self, role: str, grad_rows: torch.Tensor, inputs: torch.Tensor, grads: GradAccumulator):
        slots = self._slots[role]
        grads.add_matmul(slots.weight, grad_rows.t(), inputs)
        if slots.bias is not None:
            grads.add_rowsum(slots.bias, grad_rows)

    # -- kernel interface -------------------------------------------------------------------------
    def forward_into(self, x_shard: torch.Tensor, out_shard: Optional[torch.Tensor],
                     tensors: Sequence[torch.Tensor], shard: Optional[slice] = None) -> torch.Tensor:
        g, u, _ = self._gate_up(x_shard, tensors)
        h = self.activation.forward_mul(g, u)
        del g, u
        down_weight, down_bias = self._slots["down"].of(tensors)
        if out_shard is None:
            out = F.linear(h, down_weight, down_bias)
        elif down_bias is None:
            out = torch.mm(h, down_weight.t(), out=out_shard)
        else:
            out = torch.addmm(down_bias, h, down_weight.t(), out=out_shard)
        return out.mul_(self._down_scale) if self._down_scale != 1.0 else out

    def backward_into(self, x_shard: torch.Tensor, grad_out_shard: torch.Tensor, grad_in_shard: Optional[torch.Tensor],
                      grads: GradAccumulator, tensors: Sequence[torch.Tensor],
                      shard: Optional[slice] = None) -> Optional[torch.Tensor]:
        # ``shard`` is unused: the MLP has no sharded input but x.
        dy = grad_out_shard * self._down_scale if self._down_scale != 1.0 else grad_out_shard
        g, u, gu = self._gate_up(x_shard, tensors)
        down_weight = tensors[self._slots["down"].weight]

        h = self.activation.forward_mul(g, u)
        self._add_weight_grads("down", dy, h, grads)
        dh = torch.mm(dy, down_weight, out=h)  # h is dead once dWd has it: reuse its buffer
        del h

        dg, du = self.activation.backward_mul(dh, g, u)
        del dh
        if self._gate_scale != 1.0:
            dg.mul_(self._gate_scale)
        if self._up_scale != 1.0:
            du.mul_(self._up_scale)

        if gu is not None:
            # Fused weights: the input projection's gradient is [dg | du] in one buffer.
            if dg.data_ptr() != g.data_ptr():
                g.copy_(dg)
            if du.data_ptr() != u.data_ptr():
                u.copy_(du)
            self._add_weight_grads("gate_up", gu, x_shard, grads)
            return None if grad_in_shard is None else torch.mm(gu, tensors[self._slots["gate_up"].weight], out=grad_in_shard)

        self._add_weight_grads("gate", dg, x_shard, grads)
        self._add_weight_grads("up", du, x_shard, grads)
        if grad_in_shard is None:
            return None
        torch.mm(dg, tensors[self._slots["gate"].weight], out=grad_in_shard)
        return grad_in_shard.addmm_(du, tensors[self._slots["up"].weight])
