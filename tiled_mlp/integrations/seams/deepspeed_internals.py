"""Every call Ulysses SP makes into DeepSpeed (``seams/__init__.py``)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable

import torch
from torch import nn

from tiled_mlp.strategies import checked_versions
from tiled_mlp.strategies.checked_versions import CheckedRange

# 0.19.8, the release the package declares: on 0.19.0 (and 0.18.6) the sequence-parallel ZeRO-3 cases gave a wrong
# loss now and then, unexplained (docs/backends.md), so no earlier release counts as checked for SP either. 0.18
# wrote its Ulysses wrapper under every attention name in the process (0.19.8 under the one asked for), and its
# data-loader adapter all-gathered a 0-d tensor, which gloo refuses.
CHECKED = CheckedRange("deepspeed", "0.19.8", "0.19.8")
SP_STATE_MODULE = "deepspeed.runtime.sequence_parallel.parallel_state_sp"
# Module-level ``mpu`` slots DeepSpeed reads its parallel groups from.
MPU_SLOT_MODULES = ("deepspeed.utils.groups", "deepspeed.runtime.activation_checkpointing.checkpointing")


def require(feature: str) -> str:
    return checked_versions.require(CHECKED, feature)


def init_distributed(backend: str) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def register_ulysses(model: nn.Module, attention: str, size: int, micro_batch_size: int) -> Any:
    """Wraps what ``attention`` names in transformers' registry; creates the SP groups; returns DeepSpeed's ``mpu``."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation=attention, sequence_parallel_size=size,
        micro_batch_size=micro_batch_size, seq_length_is_variable=True)


def data_loader(loader: Iterable, rank: int, group: Any, size: int, device: torch.device) -> Any:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    return UlyssesSPDataLoaderAdapter(loader, sp_rank=rank, sp_group=group, sp_world_size=size, device=device)


def sp_groups_exist() -> bool:
    """Whether DeepSpeed's SP groups exist in this process (an earlier SP not removed, or accelerate's
    ``ParallelismConfig(sp_backend="deepspeed")``)."""
    state = sys.modules.get(SP_STATE_MODULE)
    return state is not None and getattr(state, "_SEQUENCE_PARALLEL_GROUP", None) is not None


def release_sp_groups() -> None:
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp._release_sequence_parallel_groups()


@dataclass
class DeepSpeedSlots:
    """DeepSpeed's ``mpu`` slots as they were when SP was applied: ``deepspeed.initialize(mpu=sp.mpu)`` writes the SP
    state there, and once released the next plain ``initialize`` would stop on "sequence data parallel group is not
    initialized"."""

    saved: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def remember(cls) -> DeepSpeedSlots:
        return cls({name: sys.modules[name].mpu for name in MPU_SLOT_MODULES if name in sys.modules})

    def restore(self) -> None:
        """Each slot still holding the SP state gets back what it held at apply time; others are left alone."""
        state = sys.modules.get(SP_STATE_MODULE)
        for name in MPU_SLOT_MODULES:
            module = sys.modules.get(name)
            if module is not None and state is not None and getattr(module, "mpu", None) is state:
                setattr(module, "mpu", self.saved.get(name))  # noqa: B010 - a module's global, unknown to mypy
