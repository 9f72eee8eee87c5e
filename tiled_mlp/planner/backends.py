"""How a backend divides one rank's memory, on the device and on the host: the analytic part of the plan,
stated as such.

The step itself (activations, logits, the order in which gradients appear, offloaded checkpoints) is
modelled by running it (``step.py``); what a backend adds around it is not, and is written here as
formulas with the backend's defaults, so that anyone can check them:

- ``ddp``: every rank holds all weights and gradients, plus DDP's gradient buckets (a second copy of
  the gradients; ``gradient_as_bucket_view=False`` is the default).
- ``fsdp2`` (``fully_shard`` on each decoder layer and on the root): weights and gradients divided by
  the world size; in flight, the root's parameters unsharded for the whole step (embeddings, final
  norm, LM head: the root does not reshard after forward), two decoder layers unsharded (the one
  computing and the one prefetched) and one layer's unsharded gradients before its reduce-scatter.
  Where layers differ (MoE and dense), each of the three is taken as the largest layer: a bound.
- ``zero3`` (DeepSpeed's ``stage3.py`` and ``parameter_offload.py``, defaults): the parameter partitions
  (``1 / world`` of each parameter, model dtype) on the device, or on the host with ``offload_param``
  (``param_groups_fp16_flat_cpu_memory``: then the device holds no partition at all); the gradient
  partitions (``grad_partitions_flat_buffer``, model dtype) on the device, or on the host with
  ``offload_optimizer`` (DeepSpeed puts that buffer where the optimizer runs), where the CPU Adam also
  holds a float32 copy of them (``fp32_partitioned_groups_flat[i].grad``). In flight on the device: the
  largest single module's parameters gathered (ZeRO-3 gathers per module) and that module's whole
  gradient before it is copied into the reduce bucket, the prefetch bucket (``stage3_prefetch_bucket_size``
  5e7 elements), the reduce bucket (``reduce_bucket_size`` 5e8 elements, allocated once with
  ``contiguous_gradients``) and the persistent parameters (``stage3_param_persistence_threshold``: a
  parameter of at most 1e5 elements is never partitioned; every rank holds it whole). Gathered modules
  are released after use, so ``stage3_max_live_parameters`` (1e9) is not reached by one module at a time.
- Optimizer state: Adam's two moments in float32, plus a float32 master copy when the weights are not
  float32: 8 or 12 bytes per parameter, divided by the world size under ``fsdp2`` and ``zero3``; on the
  device, or on the host (``--offload-optimizer``), where it is host memory, not held against the budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

BACKENDS = ("single", "ddp", "fsdp2", "zero3")
ZERO3_PREFETCH_ELEMENTS = 5e7
ZERO3_REDUCE_BUCKET_ELEMENTS = 5e8
ZERO3_PERSISTENCE_THRESHOLD = 100_000  # elements; a parameter this small or smaller stays whole on every rank
FP32_GRAD_BYTES = 4  # the CPU optimizer's float32 gradient, per parameter of the rank's partition

OPTIMIZER = "optimizer"
HOST_WEIGHTS, HOST_GRADS = "weights", "gradients"


@dataclass(frozen=True)
class ParamSizes:
    """Parameter counts of the full-depth model, read from its meta-device build (``layers.py``)."""

    total: int  # all parameters
    largest_layer: int  # the decoder layer with the most parameters
    root: int  # outside the decoder layers (embeddings, final norm, LM head)
    largest_module: int  # the most parameters any single module owns directly
    persistent: int = 0  # in parameters of at most ZERO3_PERSISTENCE_THRESHOLD elements (norms, biases)


@dataclass(frozen=True)
class Backend:
    name: str
    world_size: int
    # ZeRO-3's offload_param to the CPU, as ALST's one-GPU run: the parameter partitions wait on the host.
    offload_params: bool = False

    def __post_init__(self) -> None:
        if self.offload_params and self.name != "zero3":
            raise ValueError(f"parameter offload is ZeRO-3's (offload_param); --backend {self.name} has none: "
                             "give --backend zero3")

    @property
    def shards_weights(self) -> bool:
        return self.name in ("fsdp2", "zero3")

    def share(self) -> float:
        """The share of the weights, gradients and optimizer state a rank owns."""
        return 1 / self.world_size if self.shards_weights else 1.0

    def weight_scale(self) -> float:
        """The share of the weights the rank's device holds outside the backend's in-flight buffers."""
        return 0.0 if self.offload_params else self.share()

    def grad_scale(self, optimizer_on_host: bool) -> float:
        """The share of the gradients the rank's device holds at the end of the step: none under ZeRO-3
        when the optimizer runs on the host (its gradient partitions are there)."""
        return 0.0 if self.name == "zero3" and optimizer_on_host else self.share()

    def in_flight_bytes(self, sizes: ParamSizes, dtype: torch.dtype) -> float:
        """What the backend holds on the device beyond the rank's share, at the step's peak (see the
        module doc)."""
        element = torch.empty((), dtype=dtype).element_size()
        if self.name == "ddp":
            return sizes.total * element
        if self.name == "fsdp2":
            return (sizes.root + 3 * sizes.largest_layer) * element
        if self.name == "zero3":
            return (sizes.persistent + 2 * sizes.largest_module + ZERO3_PREFETCH_ELEMENTS
                    + ZERO3_REDUCE_BUCKET_ELEMENTS) * element
        return 0.0

    def weight_bytes(self, sizes: ParamSizes, dtype: torch.dtype) -> float:
        """The weights a rank's device holds all step long."""
        element = torch.empty((), dtype=dtype).element_size()
        return sizes.total * element * self.weight_scale()

    def optimizer_bytes(self, sizes: ParamSizes, dtype: torch.dtype) -> float:
        per_param = 8 + (0 if dtype == torch.float32 else 4)
        return sizes.total * per_param * self.share()

    def host_parts(self, sizes: ParamSizes, dtype: torch.dtype, optimizer_on_host: bool) -> Dict[str, float]:
        """What the backend keeps in the rank's host memory, by kind (the offloaded checkpoints, modelled,
        are added by the plan)."""
        element = torch.empty((), dtype=dtype).element_size()
        owned = sizes.total * self.share()
        parts: Dict[str, float] = {}
        if optimizer_on_host:
            parts[OPTIMIZER] = self.optimizer_bytes(sizes, dtype)
            if self.name == "zero3":
                parts[HOST_GRADS] = owned * (element + FP32_GRAD_BYTES)
        if self.offload_params:
            parts[HOST_WEIGHTS] = owned * element
        return parts
