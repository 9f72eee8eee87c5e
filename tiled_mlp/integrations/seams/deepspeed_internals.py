"""Every call Ulysses sequence parallelism makes into DeepSpeed, and the releases it was checked on.

- ``UlyssesSPAttentionHF.register_with_transformers``: wraps a model's attention in DeepSpeed's all-to-all
  and creates the SP groups; ``UlyssesSPDataLoaderAdapter``: each rank's slice of every sample;
- the SP groups' module (``parallel_state_sp``): whether its groups exist, and their release;
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
# loss now and then, unexplained (docs/backends.md), so no earlier release counts as checked for SP either. 0.18
# wrote its Ulysses wrapper under every attention name in the process (0.19.8 under the one asked for), and its
# data-loader adapter all-gathered a 0-d tensor, which gloo refuses.
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


def register_ulysses(model: nn.Module, attention: str, size: int, micro_batch_size: int) -> Any:
    """DeepSpeed's Ulysses wrapper around what ``attention`` names in transformers' ``ALL_ATTENTION_FUNCTIONS``
    (written there, under that name alone), for ``model``'s attention modules; creates the SP groups and
    returns DeepSpeed's SP state module (its ``mpu``)."""
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
    """DeepSpeed's SP groups forgotten (the process groups themselves stay with torch.distributed)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp._release_sequence_parallel_groups()
