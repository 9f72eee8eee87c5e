"""The autocast state of the forward, replayed around the backward recompute.

Without it, a forward run under ``torch.autocast`` would be recomputed in full precision and the
recomputed activations would not match the ones the output was made from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled`` for any device type; "meta" (shape-only modelling) has no autocast."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


@dataclass(frozen=True)
class AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def capture(cls, device: torch.device) -> AutocastState:
        # The state with autocast off, one per device, is captured at every tiled forward; it also holds the
        # device's type (``device.type`` builds a new string at every read).
        off = _OFF.get(device)
        device_type = device.type if off is None else off.device_type
        if not autocast_enabled(device_type):
            if off is None:
                off = _OFF[device] = cls(device_type, False, torch.float32)
            return off
        return cls(device_type, True, torch.get_autocast_dtype(device_type))

    def needs_replay(self) -> bool:
        """Whether autocast is on at either end: when the forward ran without autocast, the recompute
        must not pick up one active around the caller's ``backward()``. Off at both ends there is
        nothing to set (a context costs ~10 us on CPU)."""
        return self.enabled or autocast_enabled(self.device_type)

    def replay(self):
        """The forward's autocast state as a context (entered where ``needs_replay``)."""
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


_OFF: Dict[torch.device, AutocastState] = {}
