"""Run the tiled loss inside the output head's own call, so that the head's module hooks surround it.

A backend that gathers parameters per module (ZeRO-3) does it in hooks on the module's call. The loss reads the
head's weight without calling the head, so the head is called once here with the hidden states as its input and
the loss as its output: its forward, for that one call, is ``work``, put on the head *instance* and taken off
before ``work`` starts (the module kernel calls ``head.forward`` per shard). Hooks of the head that are not its
backend's would see the loss as the head's output: ``foreign_head_hooks`` names them for the caller to refuse.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from torch import nn

from .gated_spec import MODULE_HOOK_DICTS


class _ForwardForOneCall:
    """The head's forward for one call: puts back what was there, then runs ``work`` (an object, not a closure
    over itself: a reference cycle would keep the hidden states and the loss's site alive until a collection)."""

    def __init__(self, head: nn.Module, work: Callable[[torch.Tensor], torch.Tensor], hidden: Optional[torch.Tensor]):
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

    def __call__(self, given: torch.Tensor) -> torch.Tensor:
        self.put_back()
        if self.hidden is not None:  # as the hooks handed over the stand-in: cast, or moved by a root's hook
            given = self.hidden.to(device=given.device, dtype=given.dtype)
        return self.work(given)


def in_head_call(head: nn.Module, hidden: torch.Tensor, work: Callable[[torch.Tensor], torch.Tensor],
                 sees_graph: bool = True) -> Any:
    """``work(hidden)``, run as the forward of one call ``head(hidden)``. With ``sees_graph`` False (an FSDP2
    unit of several modules, whose hooks must not see the graph) the call is given ``hidden.detach()``, and
    ``work`` the hidden states themselves in the dtype and on the device the hooks gave the stand-in."""
    forward = _ForwardForOneCall(head, work, None if sees_graph else hidden)
    head.__dict__["forward"] = forward
    try:
        return head(hidden if sees_graph else hidden.detach())
    finally:
        forward.put_back()  # where a pre-hook raised before the forward ran


def hook_count(module: nn.Module) -> int:
    """How many hooks ``module`` itself carries (read in traced code, so that Dynamo may guard the count)."""
    return sum(len(getattr(module, name)) for name in MODULE_HOOK_DICTS)


def foreign_head_hooks(head: nn.Module, is_backend_hook: Callable[[Any], bool]) -> List[str]:
    """The hooks on ``head`` itself that are not its backend's, by name: they would fire around the loss."""
    return [getattr(hook, "__qualname__", type(hook).__qualname__)
            for name in MODULE_HOOK_DICTS for hook in getattr(head, name, {}).values() if not is_backend_hook(hook)]
