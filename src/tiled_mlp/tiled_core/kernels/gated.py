"""Fast per-shard kernel for gated MLPs: ``y = down(act(gate(x)) * up(x))``.

Backward recomputes only gate and up (2 matmul units) and never down_proj's forward:
    h  = act(g) * u            dWd += dy^T h          dh = dy Wd
    du = dh * act(g)           dg  = dh * u * act'(g)
    dWg += dg^T x   dWu += du^T x   dx = dg Wg + du Wu
so a step costs 11 matmul units against 9 untiled, where a full recompute costs 12.
Weight gradients go straight into one buffer per weight (``addmm_``) and elementwise work is done in
place, so a shard's working set is about four ``[shard_tokens, intermediate]`` buffers at its peak.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..gated_spec import GatedMLPSpec
from ..grad_accum import GradAccumulator


class GatedShardKernel:
    def __init__(self, spec: GatedMLPSpec, activation):
        self.spec = spec
        self.activation = activation
        self.params = spec.params
        # Position of each tensor in ``params`` (biases are optional), for the gradient accumulator.
        self._index = {id(p): i for i, p in enumerate(self.params)}

    # -- projections -------------------------------------------------------------------------------
    def _gate_up(self, x: torch.Tensor):
        """(g, u, gu): gu is the fused [g | u] buffer when the weights are fused, else None."""
        spec = self.spec
        if spec.gate_up is not None:
            gu = F.linear(x, spec.gate_up.weight, spec.gate_up.bias)
            g, u = gu.chunk(2, dim=-1)
            return g, u, gu
        return F.linear(x, spec.gate.weight, spec.gate.bias), F.linear(x, spec.up.weight, spec.up.bias), None

    def _add_weight_grads(self, linear, grad_rows: torch.Tensor, inputs: torch.Tensor, grads: GradAccumulator):
        grads.add_matmul(self._index[id(linear.weight)], grad_rows.t(), inputs)
        if linear.bias is not None:
            grads.add_rowsum(self._index[id(linear.bias)], grad_rows)

    # -- kernel interface -------------------------------------------------------------------------
    def forward_shard(self, x_shard: torch.Tensor, out_shard: Optional[torch.Tensor]) -> torch.Tensor:
        g, u, _ = self._gate_up(x_shard)
        h = self.activation.forward_mul(g, u)
        del g, u
        down = self.spec.down
        if out_shard is None:
            return F.linear(h, down.weight, down.bias)
        if down.bias is None:
            return torch.mm(h, down.weight.t(), out=out_shard)
        return torch.addmm(down.bias, h, down.weight.t(), out=out_shard)

    def backward_shard(
        self,
        x_shard: torch.Tensor,
        grad_out_shard: torch.Tensor,
        grad_in_shard: Optional[torch.Tensor],
        grads: GradAccumulator,
    ) -> None:
        spec = self.spec
        dy = grad_out_shard
        g, u, gu = self._gate_up(x_shard)

        h = self.activation.forward_mul(g, u)
        self._add_weight_grads(spec.down, dy, h, grads)
        dh = torch.mm(dy, spec.down.weight, out=h)  # h is dead once dWd has it: reuse its buffer
        del h

        dg, du = self.activation.backward_mul(dh, g, u)
        del dh

        if gu is not None:
            # Fused weights: the input projection's gradient is [dg | du] in one buffer.
            if dg.data_ptr() != g.data_ptr():
                g.copy_(dg)
            if du.data_ptr() != u.data_ptr():
                u.copy_(du)
            self._add_weight_grads(spec.gate_up, gu, x_shard, grads)
            if grad_in_shard is not None:
                torch.mm(gu, spec.gate_up.weight, out=grad_in_shard)
            return

        self._add_weight_grads(spec.gate, dg, x_shard, grads)
        self._add_weight_grads(spec.up, du, x_shard, grads)
        if grad_in_shard is not None:
            torch.mm(dg, spec.gate.weight, out=grad_in_shard)
            grad_in_shard.addmm_(du, spec.up.weight)
