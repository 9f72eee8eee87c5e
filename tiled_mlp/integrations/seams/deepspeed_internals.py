"""Every call Ulysses sequence parallelism makes into DeepSpeed, and the releases it was checked on.

- ``UlyssesSPAttentionHF.register_with_transformers``: wraps a model's attention in DeepSpeed's all-to-all
  and creates the SP groups; ``UlyssesSPDataLoaderAdapter``: each rank's slice of every sample;
- the SP groups' module (``parallel_state_sp``): whether its groups exist, and their release.
  ``_release_sequence_parallel_groups`` exists from 0.19; before it, the release is the same two
  module globals set to ``None``, done here;
- the module-level ``mpu`` slots DeepSpeed's engines read their parallel groups from
  (``deepspeed.utils.groups``, activation checkpointing's), which ``deepspeed.initialize(mpu=)`` fills.

``require`` refuses a DeepSpeed release outside ``CHECKED`` when SP is applied.
"""
from __future__ import annotations

import sys
from typing import Any, Iterable

import torch
from torch import nn

from tiled_mlp.strategies import checked_versions
from tiled_mlp.strategies.checked_versions import CheckedRange

# 0.19.8, the release the package declares: on 0.19.0 (and 0.18.6) the sequence-parallel ZeRO-3 cases gave a wrong
# loss now and then, unexplained (docs/backends.md), so no earlier release counts as checked for SP either. Before 0.18
# ``register_with_transformers`` took a model path only (it loaded the config itself) and overwrote every
# attention name in the process; 0.18 wrote its wrapper under every attention name (undone below).
CHECKED = CheckedRange("deepspeed", "0.19.8", "0.19.8")
SP_STATE_MODULE = "deepspeed.runtime.sequence_parallel.parallel_state_sp"
# Module-level ``mpu`` slots DeepSpeed reads its parallel groups from.
MPU_SLOT_MODULES = ("deepspeed.utils.groups", "deepspeed.runtime.activation_checkpointing.checkpointing")


def require(feature: str) -> str:
    """The installed DeepSpeed version; ``UncheckedVersionError`` outside ``CHECKED``."""
    return checked_versions.require(CHECKED, feature)


def init_distributed(backend: str) -> None:
    """DeepSpeed's communication on the process group torch.distributed already holds."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def register_ulysses(model: nn.Module, attention: str, size: int, micro_batch_size: int, functions: Any) -> Any:
    """DeepSpeed's Ulysses wrapper around what ``attention`` names in ``functions`` (transformers'
    ``ALL_ATTENTION_FUNCTIONS``), for ``model``'s attention modules; creates the SP groups and returns
    DeepSpeed's SP state module (its ``mpu``). DeepSpeed 0.18 writes its wrapper under every attention name
    in the process, 0.19 under ``attention`` alone: every other name gets back what it held (its
    per-instance override, or none)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    local = functions._local_mapping
    before = dict(local)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation=attention, sequence_parallel_size=size,
        micro_batch_size=micro_batch_size, seq_length_is_variable=True)
    for name in [name for name in local if name != attention]:
        if name in before:
            local[name] = before[name]
        else:
            del local[name]
    return mpu


# DeepSpeed's data-loader adapter: on 0.18.6 its length exchange all-gathers a 0-d tensor, which gloo
# refuses ("invalid tensor size at index 0 (expected (), got (1))"); checked on 0.19.8.
DATA_LOADER_CHECKED = CheckedRange("deepspeed", "0.19.8", "0.19.8")


def data_loader(loader: Iterable, rank: int, group: Any, size: int, device: torch.device) -> Any:
    checked_versions.require(DATA_LOADER_CHECKED, "sequence parallelism's data_loader (DeepSpeed's UlyssesSPDataLoaderAdapter)")
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    return UlyssesSPDataLoaderAdapter(loader, sp_rank=rank, sp_group=group, sp_world_size=size, device=device)


def sp_groups_exist() -> bool:
    """Whether DeepSpeed's SP groups exist in this process (an earlier SP not removed, or accelerate's
    ``ParallelismConfig(sp_backend="deepspeed")``)."""
    state = sys.modules.get(SP_STATE_MODULE)
    return state is not None and getattr(state, "_SEQUENCE_PARALLEL_GROUP", None) is not None


def release_sp_groups() -> None:
    """DeepSpeed's SP groups forgotten (the process groups themselves stay with torch.distributed)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    release = getattr(parallel_state_sp, "_release_sequence_parallel_groups", None)
    if release is not None:
        release()
    else:
        parallel_state_sp._SEQUENCE_PARALLEL_GROUP = None
        parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP = None
