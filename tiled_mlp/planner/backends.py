"""How a backend divides one rank's memory: the analytic part of the plan, stated as such.

The step itself (activations, logits, the order in which gradients appear) is modelled by running
it (``step.py``); what a backend adds around it is not, and is written here as formulas with the
backend's defaults, so that anyone can check them:

- ``ddp``: every rank holds all weights and gradients, plus DDP's gradient buckets (a second copy of
  the gradients; ``gradient_as_bucket_view=False`` is the default).
- ``fsdp2`` (``fully_shard`` on each decoder layer and on the root): weights and gradients divided by
  the world size; in flight, the root's parameters unsharded for the whole step (embeddings, final
  norm, LM head: the root does not reshard after forward), two decoder layers unsharded (the one
  computing and the one prefetched) and one layer's unsharded gradients before its reduce-scatter.
  Where layers differ (MoE and dense), each of the three is taken as the largest layer: a bound.
- ``zero3``: weights and gradients divided by the world size; in flight, the largest single module's
  parameters gathered (ZeRO-3 gathers per module), the prefetch bucket (5e7 elements) and the
  gradient reduce bucket (5e8 elements), DeepSpeed's defaults.
- Optimizer state (never in ``peak_bytes``): Adam's two moments in float32, plus a float32 master
  copy when the weights are not float32: 8 or 12 bytes per parameter, divided by the world size under
  ``fsdp2`` and ``zero3``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BACKENDS = ("single", "ddp", "fsdp2", "zero3")
ZERO3_PREFETCH_ELEMENTS = 5e7
ZERO3_REDUCE_BUCKET_ELEMENTS = 5e8


@dataclass(frozen=True)
class ParamSizes:
    """Parameter counts of the full-depth model, read from its meta-device build (``layers.py``)."""

    total: int  # all parameters
    largest_layer: int  # the decoder layer with the most parameters
    root: int  # outside the decoder layers (embeddings, final norm, LM head)
    largest_module: int  # the most parameters any single module owns directly


@dataclass(frozen=True)
class Backend:
    name: str
    world_size: int

    @property
    def shards_weights(self) -> bool:
        return self.name in ("fsdp2", "zero3")

    def weight_scale(self) -> float:
        """The share of the weights and gradients a rank holds."""
        return 1 / self.world_size if self.shards_weights else 1.0

    def in_flight_bytes(self, sizes: ParamSizes, dtype: torch.dtype) -> float:
        """What the backend holds beyond the rank's share, at the step's peak (see the module doc)."""
        element = torch.empty((), dtype=dtype).element_size()
        if self.name == "ddp":
            return sizes.total * element
        if self.name == "fsdp2":
            return (sizes.root + 3 * sizes.largest_layer) * element
        if self.name == "zero3":
            return (sizes.largest_module + ZERO3_PREFETCH_ELEMENTS + ZERO3_REDUCE_BUCKET_ELEMENTS) * element
        return 0.0

    def weight_bytes(self, sizes: ParamSizes, dtype: torch.dtype) -> float:
        element = torch.empty((), dtype=dtype).element_size()
        return sizes.total * element * self.weight_scale()

    def optimizer_bytes(self, sizes: ParamSizes, dtype: torch.dtype) -> float:
        per_param = 8 + (0 if dtype == torch.float32 else 4)
        return sizes.total * per_param * self.weight_scale()
