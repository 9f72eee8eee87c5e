"""What a training run records on each rank, shared by the FSDP2, accelerate and ZeRO runs: gradients
and parameters per step (filled by the run), and what every TiledMLP ran with at each backward; and
the step every float64 comparison (the tiled loss, checkpoint offload, SP and their references) records
alike: its loss and full gradients, the optimizer's step, its full parameters after it."""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch


def new_record() -> Dict:
    return {"grads": [], "params": [], "shards": [], "paths": set(), "strategies": set()}


def note_tiled_calls(record: Dict, tiled: Sequence) -> None:
    """Shard count, path and strategy of each TiledMLP's last call (checked by the tests)."""
    record["shards"].append([m.tiling.last_num_shards for m in tiled])
    record["paths"].update(m.tiling.last_path for m in tiled)
    record["strategies"].update(m.tiling.last_strategy.name for m in tiled)


def record_step(record: Dict, loss: torch.Tensor, named: List[Tuple[str, torch.Tensor]],
                optimizer_step: Callable[[], None],
                full_grad: Callable[[torch.Tensor], torch.Tensor] = lambda p: p.grad,
                full_param: Callable[[torch.Tensor], torch.Tensor] = lambda p: p) -> None:
    """Appends ``loss`` and every parameter's full gradient, takes the step, appends every full
    parameter after it (``full_grad``/``full_param`` gather what a backend shards)."""
    record["losses"].append(loss.detach().clone())
    record["grads"].append({n: full_grad(p).detach().clone() for n, p in named})
    optimizer_step()
    record["params"].append({n: full_param(p).detach().clone() for n, p in named})


def sgd_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """An optimizer's step and its ``zero_grad``, as one call (what DeepSpeed's ``engine.step`` does)."""
    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()
    return step
