"""Fast per-shard kernel for gated MLPs: ``y = down(act(gate(x)) * up(x))``.

Backward recomputes only gate and up (2 matmul units) and never down_proj's forward:
    h  = act(g) * u            dWd += dy^T h          dh = dy Wd
    du = dh * act(g)           dg  = dh * u * act'(g)
    dWg += dg^T x   dWu += du^T x   dx = dg Wg + du Wu
so a step costs 11 matmul units against 9 untiled, where a full recompute costs 12.
Weight gradients go straight into one buffer per weight and elementwise work is in place: a shard's working
set peaks at about four ``[shard_tokens, intermediate]`` buffers. Fixed factors (FalconH1's) scale g, u and
the output in place; backward scales dy, dg and du by the same constants.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..kernel_registry import GENERATION
from .base import ShardKernel

if TYPE_CHECKING:
    from ..sharded_autograd import GradAccumulator

# An activation's ``forward_mul(g, u)`` returns ``act(g) * u``; ``backward_mul(dh, g, u)`` returns ``(dg, du)``
# and may overwrite ``g``, ``u`` and ``dh``. A faster one for a device type is registered by whoever knows its
# library (``register_fused_kernel``).
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

    def forward_mul(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.act(g).mul_(u)

    def backward_mul(self, dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        du = self.act(g).mul_(dh)  # du = dh * act(g)
        dh.mul_(u)  # dh * u: the upstream gradient of act(g)
        # dg = dh * act'(g), written into g (same-index elementwise aliasing)
        if self.name == "silu":
            return torch.ops.aten.silu_backward.grad_input(dh, g, grad_input=g), du
        approximate = "tanh" if self.name == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_backward.grad_input(dh, g, approximate=approximate, grad_input=g), du


@dataclass(frozen=True)
class FusedKernel:
    """A faster kernel for some activations on one device type: ``factory(name)`` builds it, when
    ``available()`` (its library is installed)."""

    device_type: str
    names: FrozenSet[str]
    factory: Callable[[str], Any]
    available: Callable[[], bool]


_FUSED: List[FusedKernel] = []  # every change counts in ``kernel_registry.GENERATION``


def register_fused_kernel(device_type: str, names: Iterable[str], factory: Callable[[str], Any],
                          available: Callable[[], bool] = lambda: True) -> FusedKernel:
    """Use ``factory(name)`` (with ``forward_mul`` and ``backward_mul`` as ``NativeGatedActivation``'s) for the
    activations ``names`` on tensors of ``device_type``, whenever ``available()``."""
    names = frozenset(names)
    unknown = sorted(names - set(ACTIVATIONS))
    if unknown or not names:
        raise ValueError(f"a fused kernel computes some of {', '.join(ACTIVATIONS)}; got {sorted(names)}")
    if not isinstance(device_type, str) or not callable(factory) or not callable(available):
        raise TypeError("register_fused_kernel takes a device type name, the activation names, a factory and "
                        "an availability check")
    kernel = FusedKernel(device_type, names, factory, available)
    _FUSED.append(kernel)
    GENERATION[0] += 1
    return kernel


def unregister_fused_kernel(kernel: FusedKernel) -> None:
    _FUSED[:] = [k for k in _FUSED if k is not kernel]
    GENERATION[0] += 1


def gated_activation(name: str, device: torch.device, use_fused: bool = True):
    """The last fused kernel registered for ``name`` on ``device`` and available (when ``use_fused``), else native."""
    if use_fused:
        for kernel in reversed(_FUSED):
            if kernel.device_type == device.type and name in kernel.names and kernel.available():
                return kernel.factory(name)
    return NativeGatedActivation(name)


ROLES = ("gate", "up", "gate_up", "down")
DOWN_WEIGHT_ARG = 2 * ROLES.index("down")  # the down weight's index among ``GatedLayout.slots``


@dataclass(frozen=True)
class GatedLayout:
    """Where each projection's weight and bias sit among the kernel's tensors (two ints per role in ``ROLES``
    order, -1 where absent) and the form's fixed factors: plain values, so a custom op carries them as arguments."""

    slots: Tuple[int, ...]
    scales: Tuple[float, ...] = (1.0, 1.0, 1.0)

    def __post_init__(self) -> None:
        flat, scales = self.slots, self.scales
        if len(flat) != 2 * len(ROLES) or len(scales) != 3:
            raise ValueError(f"a gated layout is {2 * len(ROLES)} slot indices and 3 factors, got {list(flat)}, {list(scales)}")
        roles = {role for i, role in enumerate(ROLES) if flat[2 * i] >= 0}
        if "down" not in roles or not ({"gate", "up"} <= roles) ^ ("gate_up" in roles):
            raise ValueError(f"a gated layout holds down and either gate and up or gate_up, got roles {sorted(roles)}")


class GatedShardKernel(ShardKernel):
    """The formula computed directly; the forward's code and structure proved that it reads nothing but the
    input and ``params`` and draws no random numbers."""

    name = "fast"
    replays_rng = False
    runs_on_local_view = True  # plain tensors only: distributed parameters reach it through a local view
    serves_many_calls = True

    def __init__(self, layout: GatedLayout, activation, params: List[torch.Tensor], module_name: str = "the gated MLP",
                 reads: Tuple[Tuple[str, str], ...] = ()):
        self.module_name = module_name
        # The plain values the decision read, (child's name, or "" for the module itself; attribute): a named
        # scale, the attribute choosing the activation. The call plan, and a graph traced with the op
        # (``compiled_route``), hold while each is the same.
        self.reads = reads
        self.activation = activation
        self.params = params
        self.owned_params = params  # the structure proved the module owns nothing else
        self.layout = layout
        slots = layout.slots
        self._slots = {role: (slots[2 * i], None if slots[2 * i + 1] < 0 else slots[2 * i + 1])
                       for i, role in enumerate(ROLES) if slots[2 * i] >= 0}
        self._fused = "gate_up" in self._slots
        self._gate_scale, self._up_scale, self._down_scale = layout.scales

    def _linear(self, role: str, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        weight, bias = self._slots[role]
        return F.linear(x, tensors[weight], None if bias is None else tensors[bias])

    def _weight(self, role: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return tensors[self._slots[role][0]]

    def output_width(self, tensors: Sequence[torch.Tensor]) -> int:
        return self._weight("down", tensors).shape[0]

    def _gate_up(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]):
        """(g, u, gu): gu is the fused [g | u] buffer when the weights are fused, else None."""
        if self._fused:
            gu = self._linear("gate_up", x, tensors)
            g, u = gu.chunk(2, dim=-1)
        else:
            g, u, gu = self._linear("gate", x, tensors), self._linear("up", x, tensors), None
        if self._gate_scale != 1.0:
            g.mul_(self._gate_scale)
        if self._up_scale != 1.0:
            u.mul_(self._up_scale)
        return g, u, gu

    def _add_weight_grads(self, role: str, grad_rows: torch.Tensor, inputs: torch.Tensor, grads: GradAccumulator):
        weight, bias = self._slots[role]
        grads.add_matmul(weight, grad_rows.t(), inputs)
        if bias is not None:
            grads.add_rowsum(bias, grad_rows)

    def forward_into(self, x_shard: torch.Tensor, out_shard: Optional[torch.Tensor],
                     tensors: Sequence[torch.Tensor], shard: Optional[slice] = None) -> torch.Tensor:
        g, u, _ = self._gate_up(x_shard, tensors)
        h = self.activation.forward_mul(g, u)
        del g, u
        weight, bias = self._slots["down"]
        if bias is None:  # out=None (no buffer) returns a new tensor
            out = torch.mm(h, tensors[weight].t(), out=out_shard)
        else:
            out = torch.addmm(tensors[bias], h, tensors[weight].t(), out=out_shard)
        return out.mul_(self._down_scale) if self._down_scale != 1.0 else out

    def backward_into(self, x_shard: torch.Tensor, grad_out_shard: torch.Tensor, grad_in_shard: Optional[torch.Tensor],
                      grads: GradAccumulator, tensors: Sequence[torch.Tensor],
                      shard: Optional[slice] = None) -> Optional[torch.Tensor]:
        dy = grad_out_shard * self._down_scale if self._down_scale != 1.0 else grad_out_shard
        g, u, gu = self._gate_up(x_shard, tensors)
        h = self.activation.forward_mul(g, u)
        self._add_weight_grads("down", dy, h, grads)
        dh = torch.mm(dy, self._weight("down", tensors), out=h)  # h is dead once dWd has it: reuse its buffer
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
            return None if grad_in_shard is None else torch.mm(gu, self._weight("gate_up", tensors), out=grad_in_shard)
        self._add_weight_grads("gate", dg, x_shard, grads)
        self._add_weight_grads("up", du, x_shard, grads)
        if grad_in_shard is None:
            return None
        torch.mm(dg, self._weight("gate", tensors), out=grad_in_shard)
        return grad_in_shard.addmm_(du, self._weight("up", tensors))
