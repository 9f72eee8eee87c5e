"""The parts of a gated MLP that the fast kernel computes with, and the structure check that lets it: the
forward is proven to compute the gated formula (``gated_forms``), the projections are plain ``nn.Linear``
with no hooks, and the module owns nothing else (no other parameter, buffer, submodule or tensor
attribute). Any doubt means the generic path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_globals

from .code_forms import CodeForm, matches
from .gated_forms import GatedForm, activation_name, called_as_torch_calls, linear_is_a_linear, shadowed
from .kernels.gated import ROLES, GatedLayout
from .kernels.lm_head import is_plain_linear


@dataclass(frozen=True)
class GatedMLPSpec:
    """What the fast kernel computes a proven gated MLP with: its activation, where each projection's tensors
    sit among ``params`` and the fixed factors (``layout``), and the projections' weights and biases, each
    tensor once (gate and up tied: one buffer gets both roles')."""

    activation: str
    layout: GatedLayout
    params: List[torch.Tensor]


def no_hook_is_backend(hook) -> bool:
    return False


# The hook dicts a module call runs: each module's own, and those registered for every module.
MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks")


def foreign_child_hooks(module: nn.Module, is_backend_hook=no_hook_is_backend) -> List[str]:
    """The hooks below ``module`` that a tiled call would not run as untiled, by name: the fast kernel calls
    no submodule. A backend's own (ZeRO-3's gather) is stood in for by the strategy's ``gathered``."""
    found = [f"every module: {getattr(h, '__qualname__', type(h).__name__)}"  # ``register_module_forward_hook``'s
             for hook_dict in _GLOBAL_HOOK_DICTS for h in getattr(_module_globals, hook_dict, {}).values()
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


_LINEAR = CodeForm("return F.linear({x}, self.weight, self.bias)", {"F": F})


def _beyond_spec(module: nn.Module, params: List[torch.Tensor], parts: List[nn.Module]) -> str:
    """What the module holds besides the projections' ``params`` and its ``parts`` ("" when nothing): it would
    change the result or get no gradient, and a numerical probe cannot rule it out (neutral at init)."""
    wanted = {id(p) for p in params}
    extra = [name for name, p in module.named_parameters() if id(p) not in wanted]
    if extra:
        return f"parameters besides the projections' ({', '.join(extra)})"
    buffers = [name for name, _ in module.named_buffers()]
    if buffers:
        return f"buffers ({', '.join(buffers)})"
    allowed = set(map(id, parts))
    subs = [name for name, m in module.named_modules() if name and id(m) not in allowed]
    if subs:
        return f"submodules besides the projections and the activation ({', '.join(subs)})"
    tensors = [f"{prefix}{'.' if prefix else ''}{key}" for prefix, m in module.named_modules()
               for key, value in vars(m).items() if isinstance(value, torch.Tensor)]
    if tensors:
        return f"tensor attributes outside its parameters ({', '.join(tensors)})"
    return ""


def structural_spec(module: nn.Module, form: GatedForm,
                    is_backend_hook=no_hook_is_backend) -> Tuple[Optional[GatedMLPSpec], str]:
    """The spec if the module's structure lets the fast kernel compute ``form``, else None and why not."""
    hooks = foreign_child_hooks(module, is_backend_hook)
    if hooks:
        return None, f"submodules have hooks that the fast kernel would skip ({', '.join(hooks)})"
    roles = {role: getattr(form, role) for role in ROLES if getattr(form, role) is not None}
    names, attributes = (*roles.values(), form.activation), module.__dict__
    factors = (form.gate_scale, form.up_scale, form.down_scale)
    scale_names = [s for s in factors if isinstance(s, str)]
    if shadowed(module, (*names, *scale_names)):
        return None, "its class defines an attribute the forward reads, or a custom attribute lookup"
    # An instance attribute of a child's name is found before the child (children live in ``_modules``).
    if not attributes.keys().isdisjoint(names):
        return None, f"an instance attribute hides the submodule {', '.join(n for n in names if n in attributes)}"
    parts = attributes["_modules"]
    missing = [name for name in names if not isinstance(parts.get(name), nn.Module)]
    if missing:
        return None, f"no submodule {', '.join(missing)}"
    act_module = parts[form.activation]
    act = activation_name(act_module)
    if act is None:
        return None, f"{form.activation} ({type(act_module).__name__}) is not a recognised activation (silu, gelu, gelu tanh)"
    # A named factor is read from the instance (its class was checked above); a bool is no factor.
    scales: List[Any] = [attributes.get(s) if isinstance(s, str) else s for s in factors]
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scales):
        return None, f"a scale it multiplies by ({', '.join(scale_names)}) is not a plain number"
    linears = {role: parts[name] for role, name in roles.items()}
    if not all(type(m) is nn.Linear and is_plain_linear(m, is_backend_hook) for m in linears.values()) or not (
            matches(nn.Linear.forward, _LINEAR) and linear_is_a_linear(F.linear)):
        return None, "projections are not plain nn.Linear (LoRA or quantised wrappers)"
    if any(shadowed(m, ("weight", "bias")) for m in linears.values()):
        return None, "nn.Linear's class defines weight or bias, or a custom attribute lookup, which its forward would read"
    if not all(called_as_torch_calls(type(m)) for m in (*linears.values(), act_module)):
        return None, "a submodule's class is called through a patched __call__, which the fast kernel (calling no submodule) would skip"
    if "gate_up" in linears and linears["gate_up"].out_features % 2:
        return None, "gate_up_proj has an odd number of outputs"
    params = list({id(t): t for m in linears.values() for t in (m.weight, m.bias) if t is not None}.values())
    extra = _beyond_spec(module, params, [*linears.values(), act_module])
    if extra:
        return None, f"the module has {extra}"
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        return None, f"the projections' weights have different dtypes ({sorted(map(str, dtypes))})"
    index = {id(p): i for i, p in enumerate(params)}
    slots = tuple(index.get(id(getattr(linears.get(role), attr, None)), -1) for role in ROLES for attr in ("weight", "bias"))
    return GatedMLPSpec(act, GatedLayout(slots, tuple(map(float, scales))), params), ""
