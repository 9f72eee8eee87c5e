"""Python overhead per call, on shapes so small that Python dominates (16 tokens, hidden 64).

On a GPU a 4096/12288 MLP forward at 2048 tokens takes about 0.8 ms, so every 100 us a call spends
in Python is +12% on that layer. Measured, one thread, median of repeated blocks of calls:

- pass-through: ``TiledMLP`` with ``num_shards="auto"`` on too few tokens to tile runs the module
  itself; its forward against the plain module's forward;
- tiled: the fast path at 4 shards, forward+backward, against the kernel's own work (the same four
  shards' forward and backward computed by calling the kernel directly, no autograd, no module);
- and the floor under that: the same kernel work inside one bare autograd Function (save the input,
  loop the shards, return the input and weight gradients), i.e. what autograd itself costs for a
  custom Function with this many inputs, which no tiled call can go below.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Callable, Dict

import torch

from tiled_mlp import TiledMLP
from tiled_mlp.core.shard_plan import make_shard_plan
from tiled_mlp.core.sharded_autograd import GradAccumulator

from .mlp import SwiGLUMLP

TOKENS, HIDDEN, INTERMEDIATE, SHARDS = 16, 64, 176, 4


def per_call_us(fns: Dict[str, Callable[[], object]], calls: int, blocks: int = 9) -> Dict[str, float]:
    """Median microseconds per call of each function, over ``blocks`` blocks of ``calls`` calls, the
    functions' blocks interleaved: this machine drifts by tens of percent over seconds, and
    interleaving puts a slow spell on every function alike (as ``tiled-mlp bench`` does)."""
    for fn in fns.values():
        for _ in range(max(10, calls // 10)):
            fn()
    times: Dict[str, list] = {name: [] for name in fns}
    for _ in range(blocks):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def measure(calls: int = 500) -> Dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mlp = SwiGLUMLP(HIDDEN, INTERMEDIATE)
    passthrough = TiledMLP(copy.copy(mlp))  # auto: 16 tokens are far too few to tile
    tiled = TiledMLP(copy.copy(mlp), num_shards=SHARDS, path="fast")
    x = torch.randn(1, TOKENS, HIDDEN, requires_grad=True)
    dy = torch.randn(1, TOKENS, HIDDEN)

    def fwd_bwd(module):
        def step():
            module(x).backward(dy)
        return step

    passthrough(x)
    assert passthrough.tiling.last_path == "untiled"
    tiled(x).backward(dy)
    assert tiled.tiling.last_path == "fast" and tiled.tiling.last_num_shards == SHARDS
    call_plan = tiled.tiling.call_plan
    assert call_plan is not None and call_plan.fast_kernel is not None
    kernel = call_plan.fast_kernel
    params = kernel.params
    plan = make_shard_plan(TOKENS, SHARDS)
    x_flat, dy_flat = x.detach().reshape(TOKENS, HIDDEN), dy.reshape(TOKENS, HIDDEN)

    def kernel_work():
        with torch.no_grad():
            out = torch.empty(TOKENS, HIDDEN)
            dx = torch.empty(TOKENS, HIDDEN)
            grads = GradAccumulator(params, [True] * len(params))
            for shard in plan.slices():
                kernel.forward_into(x_flat[shard], out[shard], params, shard)
            for shard in plan.slices():
                kernel.backward_into(x_flat[shard], dy_flat[shard], dx[shard], grads, params, shard)
            grads.results()

    class BareFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, *weights):
            ctx.save_for_backward(inp)
            out = torch.empty(TOKENS, HIDDEN)
            for shard in plan.slices():
                kernel.forward_into(x_flat[shard], out[shard], weights, shard)
            return out.view_as(inp)

        @staticmethod
        def backward(ctx, grad_out):
            (inp,) = ctx.saved_tensors
            dx = torch.empty(TOKENS, HIDDEN)
            grads = GradAccumulator(params, [True] * len(params))
            for shard in plan.slices():
                kernel.backward_into(x_flat[shard], grad_out.reshape(TOKENS, HIDDEN)[shard], dx[shard], grads, params, shard)
            return (dx.view_as(inp), *grads.results())

    results = per_call_us({
        "plain forward": lambda: mlp(x),
        "pass-through forward": lambda: passthrough(x),
        "plain forward+backward": fwd_bwd(mlp),
        "tiled forward (4 shards)": lambda: tiled(x),
        "tiled forward+backward (4 shards)": fwd_bwd(tiled),
        "kernel work forward+backward (4 shards)": kernel_work,
        "bare Function forward+backward (4 shards)": lambda: BareFunction.apply(x, *params).backward(dy),
    }, calls)
    results["pass-through overhead"] = results["pass-through forward"] - results["plain forward"]
    results["tiled overhead over kernel work"] = (results["tiled forward+backward (4 shards)"]
                                                 - results["kernel work forward+backward (4 shards)"])
    results["bare Function over kernel work (autograd's floor)"] = (
        results["bare Function forward+backward (4 shards)"] - results["kernel work forward+backward (4 shards)"])
    results["tiled overhead over the bare Function"] = (results["tiled forward+backward (4 shards)"]
                                                       - results["bare Function forward+backward (4 shards)"])
    return results
