"""Run the tiled loss inside the output head's own call, so that the head's module hooks surround it.

A backend that gathers parameters per module (ZeRO-3) does it in hooks on the module's call: gather before its
forward and release after, and again around its backward. The loss reads the head's weight without calling the
head, so the head is called once here, with the hidden states as its input and the loss as its output: its
forward, for that one call, is ``work``. That forward is put on the head *instance* and takes itself off before
``work`` starts, so ``work`` (the module kernel calls ``head.forward`` per shard) sees the real one. Hooks of the
head that are not its backend's would see the loss as the head's output: ``foreign_head_hooks`` names them and
the caller refuses them before any work; hooks registered for every module are not refused.

A backend whose hooks must not see the hidden states' graph (``Strategy.head_call_sees_graph``, an FSDP2 unit
of several modules) is handed a detached stand-in: its hooks gather and release as for any call, and ``work``
computes with the hidden states themselves, in the dtype and on the device the hooks gave the stand-in.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from torch import nn

from .gated_spec import MODULE_HOOK_DICTS


class _ForwardForOneCall:
    """The head's forward for one call: puts back what was there, then runs ``work`` on the input that
    the head's pre-hooks handed over (ZeRO-3 wraps it to learn when its gradient is out)."""

    def __init__(self, head: nn.Module, work: Callable[[torch.Tensor], torch.Tensor],
                 hidden: Optional[torch.Tensor] = None):
        self.head = head
        self.work = work
        self.hidden = hidden  # where the head is given a stand-in: the hidden states the loss computes with
        self.had_own = "forward" in vars(head)
        self.previous = vars(head).get("forward")

    def put_back(self) -> None:
        if vars(self.head).get("forward") is not self:
            return
        if self.had_own:
            self.head.__dict__["forward"] = self.previous
        else:
            del self.head.__dict__["forward"]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.put_back()
        if self.hidden is not None:  # as the hooks handed over the stand-in: cast, or moved by a root's hook
            hidden = self.hidden.to(device=hidden.device, dtype=hidden.dtype)
        return self.work(hidden)


def in_head_call(head: nn.Module, hidden: torch.Tensor, work: Callable[[torch.Tensor], torch.Tensor],
                 sees_graph: bool = True) -> Any:
    """``work(hidden)``, run as the forward of one call of ``head`` (``head(hidden)``); with ``sees_graph``
    False, the call is given ``hidden.detach()`` and ``work`` the hidden states themselves."""
    forward = _ForwardForOneCall(head, work, None if sees_graph else hidden)
    head.__dict__["forward"] = forward
    try:
        return head(hidden if sees_graph else hidden.detach())
    finally:
        forward.put_back()  # where a pre-hook raised before the forward ran


def hook_count(module: nn.Module) -> int:
    """How many hooks ``module`` itself carries, of the four kinds its call runs (read in traced code by the
    compiled routes, so that Dynamo may guard the count)."""
    return sum(len(getattr(module, name)) for name in MODULE_HOOK_DICTS)


def foreign_head_hooks(head: nn.Module, is_backend_hook: Callable[[Any], bool]) -> List[str]:
    """The hooks on ``head`` itself that are not its backend's, by name: they would fire around the loss."""
    return [getattr(hook, "__qualname__", type(hook).__qualname__)
            for name in MODULE_HOOK_DICTS for hook in getattr(head, name, {}).values() if not is_backend_hook(hook)]
