"""Collectives inside a generic-path shard, on each rank of a gloo group: what the kept-tensor watch records of
them (``TensorReads``), and modules whose forward runs a collective on memory that lives longer than the shard (a
buffer kept in sync, the call's own input), tiled against the same module untiled (float64)."""
from __future__ import annotations

import copy
from typing import Dict

import torch
import torch.distributed as dist
from torch import nn

HIDDEN, INTERMEDIATE, CALLS = 8, 16, 3


def in_strict_mode(rank: int, world: int, case, *args) -> object:
    """``case`` run in strict mode (``tiled_core/strict.py``), where kept tensors are looked for: a rank is
    forked from a server that imported the library before the test's environment was set."""
    from tiled_mlp.core.strict import strict_mode

    with strict_mode():
        return case(rank, world, *args)


def collectives_seen(rank: int, world: int) -> Dict[str, object]:
    """What the watch records of a collective: torch.distributed's own in-place ``all_reduce`` (what DeepSpeed
    AutoTP's layers call), a functional one called as DTensor calls it (the operator packet), and a plain op;
    and whose memory it reports while the results are alive."""
    import torch.distributed._functional_collectives as funcol

    from tiled_mlp.core.tensor_reads import TensorReads

    x = torch.ones(4, dtype=torch.float64)
    reads = TensorReads(known=[x], watch_kept=True)
    with reads:
        in_place = x * 2
        dist.all_reduce(in_place)
        # The inputs held until the plain tensor is made: the watch records tensors by id while they live, and a
        # dead input's id taken by the plain one would count it as the collective's (a wait, in a tiled call).
        packet_input, functional_input = x * 3, x * 4
        packet = torch.ops._c10d_functional.all_reduce(packet_input, "sum", dist.group.WORLD.group_name)
        functional = funcol.all_reduce(functional_input, "sum", dist.group.WORLD)
        plain = x * 5
    del packet_input, functional_input
    results = [funcol.wait_tensor(packet), functional.wait()]
    return {"in_place": reads.held_by_collective(in_place), "packet": reads.held_by_collective(packet),
            "functional": reads.held_by_collective(functional.elem), "plain": reads.held_by_collective(plain),
            "memory_alive": len(reads.collective_memory()),
            "memory_expected": len(reads.collective_memory(expected=[in_place, *results]))}


class BroadcastBufferMLP(nn.Module):
    """Keeps a scale buffer in sync from rank 0 at every forward: a collective on memory from before the call."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, INTERMEDIATE, dtype=torch.float64)
        self.fc2 = nn.Linear(INTERMEDIATE, HIDDEN, dtype=torch.float64)
        self.register_buffer("scale", torch.ones(INTERMEDIATE, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(self.scale, src=0)
        return self.fc2(torch.relu(self.fc1(x)) * self.scale)


class GatherInputMLP(nn.Module):
    """A residual stream split along hidden over the ranks: all-gather the input's slices (a view of them, as a
    module that reshapes its input makes), a local MLP, this rank's slice of its output added to the input.
    Token-wise."""

    def __init__(self, world: int, keep_what_was_sent: bool = False):
        super().__init__()
        self.world = world
        self.keep_what_was_sent = keep_what_was_sent
        # Not named as a first projection (``fc1``): its input is the gathered width, not the call's.
        self.inner = nn.Linear(HIDDEN * world, INTERMEDIATE, dtype=torch.float64)
        self.outer = nn.Linear(INTERMEDIATE, HIDDEN * world, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        sent = x.view(x.shape)
        dist.all_gather(parts, sent)
        if self.keep_what_was_sent:  # a stash: one shard's view of the input, kept past the shard
            self.sent = sent
        y = self.outer(torch.relu(self.inner(torch.cat(parts, dim=-1))))
        rank = dist.get_rank()
        return x + y[..., rank * HIDDEN:(rank + 1) * HIDDEN]  # the residual: the input's own gradient


def _relative_error(want, have) -> float:
    """max |want - have| / max |want|; a gradient untiled gives none of (``dist.all_gather`` is no autograd op)
    must be none tiled too (infinite error otherwise)."""
    if want is None or have is None:
        return 0.0 if want is None and have is None else float("inf")
    return float((want - have).abs().max() / want.abs().max())


def long_lived_memory_runs(rank: int, world: int) -> Dict[str, float]:
    """Each module tiled (3 shards, the generic kernel) against its untiled copy on the same inputs, over
    ``CALLS`` calls: the largest relative error of the output, the input gradient and every parameter gradient."""
    from tiled_mlp import TiledMLP

    errors: Dict[str, float] = {}
    for name, build in (("broadcast_buffer", BroadcastBufferMLP), ("gather_input", lambda: GatherInputMLP(world))):
        torch.manual_seed(0)
        untiled = build()
        tiled = TiledMLP(copy.deepcopy(untiled), num_shards=3, path="generic")
        worst = 0.0
        for call in range(CALLS):
            x = torch.randn(2, 12, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(call))
            dy = torch.randn(2, 12, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + call))
            runs = []
            for module in (untiled, tiled):
                module.zero_grad()
                x_in = x.clone().requires_grad_(True)
                y = module(x_in)
                y.backward(dy)
                runs.append([y.detach(), x_in.grad, *(p.grad for p in module.parameters())])
            worst = max(worst, *(_relative_error(w, h) for w, h in zip(*runs, strict=True)))
        errors[name] = worst
        errors[name + "_path"] = float(tiled.tiling.last_path == "generic")
    return errors


def kept_input_view(rank: int, world: int) -> str:
    """The error a forward that keeps the view of its input it all-gathered raises when tiled (it is no memory the
    shard made, but the view itself must not outlive the shard), or what the call returned."""
    from tiled_mlp import TiledMLP

    torch.manual_seed(0)
    module = TiledMLP(GatherInputMLP(world, keep_what_was_sent=True), num_shards=3, path="generic")
    try:
        module(torch.randn(2, 12, HIDDEN, dtype=torch.float64, requires_grad=True)).sum().backward()
    except RuntimeError as error:
        return f"raised: {error}"
    return "returned"
