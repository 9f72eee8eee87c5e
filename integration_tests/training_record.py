"""What a training run records on each rank, shared by the FSDP2, accelerate and ZeRO runs: gradients
and parameters per step (filled by the run), and what every TiledMLP ran with at each backward."""
from __future__ import annotations

from typing import Dict, Sequence


def new_record() -> Dict:
    return {"grads": [], "params": [], "shards": [], "paths": set(), "strategies": set()}


def note_tiled_calls(record: Dict, tiled: Sequence) -> None:
    """Shard count, path and strategy of each TiledMLP's last call (checked by the tests)."""
    record["shards"].append([m.tiling.last_num_shards for m in tiled])
    record["paths"].update(m.tiling.last_path for m in tiled)
    record["strategies"].update(m.tiling.last_strategy.name for m in tiled)
