"""``torch.library.opcheck`` on the gated MLP and loss ops (schema, fake kernel, autograd registration, and
the op against its own eager call), over the layouts and options they carry, and over the memory layouts of
their tensors (a transposed input, a column-major weight: the fake kernel must give the strides the op
returns, or a compiled graph reads its gradients wrongly). The norm op's are in ``test_norm_op.py``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import laid_out

from tiled_mlp.core.kernels.gated import GatedLayout
from tiled_mlp.core.ops import gated_mlp  # noqa: F401  # registers the ops
from tiled_mlp.core.ops.linear_cross_entropy import linear_cross_entropy  # noqa: F401

pytestmark = pytest.mark.timeout(60)


MEMORY_LAYOUTS = ("contiguous", "transposed")


def _gated_args(fused: bool, bias: bool, memory: str = "contiguous"):
    generator = torch.Generator().manual_seed(0)

    def t(*shape):
        made = torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)
        return laid_out(made, memory) if len(shape) > 1 else made

    hidden, inner = 6, 10
    tensors = [t(2 * inner, hidden)] if fused else [t(inner, hidden), t(inner, hidden)]
    tensors += [t(hidden, inner)] + ([t(hidden)] if bias else [])
    # Two ints per role (gate, up, gate_up, down): weight and bias index, -1 where absent.
    down = [1, 2 if bias else -1] if fused else [2, 3 if bias else -1]
    slots = ([-1, -1, -1, -1, 0, -1] if fused else [0, -1, 1, -1, -1, -1]) + down
    GatedLayout(tuple(slots), (0.5, 1.0, 2.0))  # a layout the op accepts
    return t(2, 7, hidden), tensors, slots, [0.5, 1.0, 2.0]


@pytest.mark.parametrize("memory", MEMORY_LAYOUTS)
@pytest.mark.parametrize("fused,bias", [(False, False), (False, True), (True, False)])
def test_gated_mlp_op_passes_opcheck(fused, bias, memory):
    x, tensors, slots, scales = _gated_args(fused, bias, memory)
    torch.library.opcheck(torch.ops.tiled_mlp.gated_mlp.default, (x, tensors, slots, scales, "gelu_tanh", False, 3, None))


@pytest.mark.parametrize("memory", MEMORY_LAYOUTS)
@pytest.mark.parametrize("fused,bias", [(False, False), (True, False)])
def test_gated_mlp_backward_op_passes_opcheck(fused, bias, memory):
    x, tensors, slots, scales = _gated_args(fused, bias, memory)
    grad_out = laid_out(torch.randn(2, 7, x.shape[-1], dtype=torch.float64), memory)
    needs = [True] * (1 + len(tensors))
    torch.library.opcheck(torch.ops.tiled_mlp.gated_mlp_backward.default,
                          (grad_out, x.detach(), [t.detach() for t in tensors], slots, scales, "gelu_tanh", False, 3, None,
                           needs))


@pytest.mark.parametrize("memory", MEMORY_LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_op_passes_opcheck(bias, memory):
    generator = torch.Generator().manual_seed(0)
    x = laid_out(torch.randn(2, 7, 6, generator=generator, dtype=torch.float64, requires_grad=True), memory)
    weight = laid_out(torch.randn(11, 6, generator=generator, dtype=torch.float64, requires_grad=True), memory)
    b = torch.randn(11, generator=generator, dtype=torch.float64, requires_grad=True) if bias else None
    labels = torch.randint(0, 11, (2, 7), generator=generator)
    labels[0, 2] = -100
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    scale = (targets != -100).sum().double().reciprocal()
    torch.library.opcheck(torch.ops.tiled_mlp.linear_cross_entropy.default,
                          (x, targets, scale, weight, b, -100, 0.1, 5.0, 1e-3, 3, None, True, True, bias))


@pytest.mark.parametrize("slots, scales, match", [
    ([0, -1, 1, -1, -1, -1], (1.0, 1.0, 1.0), "8 slot indices"),
    ([0, -1, 1, -1, 2, -1, 3, -1], (1.0, 1.0, 1.0), "either gate and up or gate_up"),  # both
    ([0, -1, -1, -1, -1, -1, 1, -1], (1.0, 1.0, 1.0), "either gate and up or gate_up"),  # up missing
    ([0, -1, 1, -1, -1, -1, -1, -1], (1.0, 1.0, 1.0), "holds down"),
])
def test_the_gated_op_refuses_a_layout_it_cannot_compute(slots, scales, match):
    x, tensors, _, _ = _gated_args(False, False)
    with pytest.raises(ValueError, match=match):
        torch.ops.tiled_mlp.gated_mlp(x, tensors, slots, list(scales), "silu", False, 3, None)
