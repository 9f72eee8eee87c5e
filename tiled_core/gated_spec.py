"""The hooks a module's call runs besides its forward, and those below a module that a tiled call computing
without calling its submodules (the fast kernel) would skip.
"""
from __future__ import annotations

from typing import List

from torch import nn
from torch.nn.modules import module as _module_globals


def no_hook_is_backend(hook) -> bool:
    return False


# The hook dicts a module call runs: each module's own, and those registered for every module.
MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                     "_global_backward_pre_hooks")


def hook_count(module: nn.Module) -> int:
    """Read in traced code, so that Dynamo may guard the count."""
    return sum(len(getattr(module, name)) for name in MODULE_HOOK_DICTS)


def foreign_child_hooks(module: nn.Module, is_backend_hook=no_hook_is_backend) -> List[str]:
    """The hooks below ``module`` that a tiled call would not run as untiled, by name: the fast kernel calls
    no submodule. A backend's own (ZeRO-3's gather) is stood in for by the strategy's ``gathered``."""
    found = [f"every module: {getattr(h, '__qualname__', type(h).__name__)}"  # ``register_module_forward_hook``'s
             for hook_dict in GLOBAL_HOOK_DICTS for h in getattr(_module_globals, hook_dict, {}).values()
             if not is_backend_hook(h)]
    for name, sub in module.named_modules():
        if not name:
            continue
        # A forward replaced on the instance (accelerate's offload hooks) is a hook too, unless the backend's own.
        if "forward" in sub.__dict__ and not is_backend_hook(sub.__dict__["forward"]):
            found.append(f"{name}: a replaced forward")
        found.extend(f"{name}: {getattr(h, '__qualname__', type(h).__name__)}"
                     for hook_dict in MODULE_HOOK_DICTS for h in getattr(sub, hook_dict, {}).values()
                     if not is_backend_hook(h))
    return found
