"""Whether a module may take the gated fast kernel, whatever the call: decided once, from what the forward is
(``gated_forms``) and the module's structure, never by running it.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .code_forms import CodeForm, matches
from .gated_forms import (
    called_as_torch_calls,
    known_form,
    linear_is_a_linear,
    recognised_activation,
    shadowed,
)
from .gated_spec import foreign_child_hooks, no_hook_is_backend
from .kernels.gated import ROLES, GatedLayout, GatedShardKernel, NativeGatedActivation
from .module_forward import forward_function, is_tiled

UNKNOWN_FORWARD = ("its forward is not one the fast kernel is known to compute (a known library body, or a class "
                   "declared with register_gated_mlp)")


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


def structural_decision(module: nn.Module, forward_fn: Optional[Callable], is_backend_hook: Callable = no_hook_is_backend,
                        mixin: Optional[type] = None) -> Tuple[Optional[GatedShardKernel], str]:
    """(the fast kernel for it, with the native activation, "") when ``forward_fn`` (what the module's forward
    runs) is proven to compute a gated form, and the module's structure lets the fast kernel compute it: the
    projections are plain ``nn.Linear`` with no hooks, and the module owns nothing else. Else (None, why not): any
    doubt means the generic path. ``mixin``: the tiling class, where the module is not tiled yet."""
    unfit = getattr(mixin or type(module), "tiled_no_fast_path", "")  # a tiling class's own refusal (TiledNorm's)
    if unfit:
        return None, unfit
    form = known_form(forward_fn)
    if form is None:
        return None, UNKNOWN_FORWARD
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
    act, act_reads = recognised_activation(act_module)
    if act is None:
        return None, f"{form.activation} ({type(act_module).__name__}) is not a recognised activation (silu, gelu, gelu tanh)"
    # A named factor is read from the instance (its class was checked above); a bool is no factor.
    scales: List[Any] = [attributes.get(s) if isinstance(s, str) else s for s in factors]
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scales):
        return None, f"a scale it multiplies by ({', '.join(scale_names)}) is not a plain number"
    linears = {role: parts[name] for role, name in roles.items()}
    # An instance forward on a projection was refused with the hooks above.
    if not all(type(m) is nn.Linear for m in linears.values()) or not (
            matches(nn.Linear.forward, _LINEAR) and linear_is_a_linear(F.linear)):
        return None, "projections are not plain nn.Linear (LoRA or quantised wrappers)"
    if any(shadowed(m, ("weight", "bias")) for m in linears.values()):
        return None, "nn.Linear's class defines weight or bias, or a custom attribute lookup, which its forward would read"
    if not all(called_as_torch_calls(type(m)) for m in (*linears.values(), act_module)):
        return None, "a submodule's class is called through a patched __call__, which the fast kernel (calling no submodule) would skip"
    if "gate_up" in linears and linears["gate_up"].out_features % 2:
        return None, "gate_up_proj has an odd number of outputs"
    # Each tensor once (gate and up tied: one buffer gets both roles).
    params = list({id(t): t for m in linears.values() for t in (m.weight, m.bias) if t is not None}.values())
    extra = _beyond_spec(module, params, [*linears.values(), act_module])
    if extra:
        return None, f"the module has {extra}"
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        return None, f"the projections' weights have different dtypes ({sorted(map(str, dtypes))})"
    index = {id(p): i for i, p in enumerate(params)}
    slots = tuple(index.get(id(getattr(linears.get(role), attr, None)), -1) for role in ROLES for attr in ("weight", "bias"))
    layout = GatedLayout(slots, tuple(map(float, scales)))
    reads = (*(("", name) for name in scale_names), *((form.activation, a) for a in act_reads))
    return GatedShardKernel(layout, NativeGatedActivation(act), params, type(module).__name__, reads), ""


class FastPathRefused(ValueError):
    """``path="fast"`` asked of a module the fast kernel cannot run."""


def fast_refused(module: nn.Module, why_not: str) -> FastPathRefused:
    return FastPathRefused(f"path='fast' cannot apply to {type(module).__name__}: {why_not}; use path='auto'")


def fast_path_problem(mixin: type, mlp: nn.Module, is_backend_hook: Callable = no_hook_is_backend) -> str:
    """Why the fast kernel could never run ``mlp`` (tiled or not), whatever the call ("" when it may)."""
    if is_tiled(mlp):
        forward = forward_function(mlp)
    else:  # not tiled yet: an instance forward here is another library's (accelerate's hooks)
        forward = None if "forward" in mlp.__dict__ else type(mlp).forward
    return structural_decision(mlp, forward, is_backend_hook, mixin)[1]
