"""The parts of a gated MLP (``down(act(gate(x)) * up(x))``) that the fast kernel computes with.

The fast kernel bypasses the module's own forward, so it is used only when two things are proven:
the forward computes the gated formula from children it names (``gated_forms``: by the forward's
code or a registration, never by running it), and the structure leaves nothing out. The structure
check is this file: the projections are plain ``nn.Linear`` (not LoRA or quantised wrappers) with no
hooks, the module owns nothing else (no other parameter, buffer, submodule or tensor attribute), it
has no dropout, and the activation is one we differentiate exactly. Any doubt means the generic path.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_globals

from .code_forms import CodeForm, matches
from .gated_forms import (
    CodeRead,
    GatedForm,
    ProofReads,
    activation_reads,
    called_as_torch_calls,
    check_attributes,
    linear_is_a_linear,
    resolve_scale,
    shadowed,
)


@dataclass
class GatedMLPSpec:
    """The tensors of a gated MLP. ``gate_up`` is set for a fused ``[gate; up]`` projection."""

    activation: str
    down: nn.Linear
    gate: Optional[nn.Linear] = None
    up: Optional[nn.Linear] = None
    gate_up: Optional[nn.Linear] = None
    # The forward's fixed factors: gate(x) and up(x) are multiplied before the activation's product,
    # down's output after it (a form's fixed multipliers; 1.0 where it has none).
    gate_scale: float = 1.0
    up_scale: float = 1.0
    down_scale: float = 1.0
    form: GatedForm = GatedForm()  # the names the forward reads them by
    # What the decision read outside the module tree's own dicts (its classes, how its children are
    # called, its forwards' module globals): checked at every call that reuses it, which the plan's
    # snapshot (each class by identity only) cannot see.
    proof_reads: Optional[ProofReads] = None

    @property
    def linears(self) -> List[nn.Linear]:
        first = [self.gate_up] if self.gate_up is not None else [self.gate, self.up]
        return [linear for linear in (*first, self.down) if linear is not None]

    @property
    def params(self) -> List[torch.Tensor]:
        """The projections' weights and biases, each tensor once: projections that share one (gate and up tied)
        point to its one place, and the kernel sums both roles' gradients into its one buffer."""
        once: Dict[int, torch.Tensor] = {}
        for linear in self.linears:
            for tensor in (linear.weight, linear.bias):
                if tensor is not None:
                    once.setdefault(id(tensor), tensor)
        return list(once.values())


def no_hook_is_backend(hook) -> bool:
    return False


# The hook dicts a module call runs: each module's own, and those registered for every module.
MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks")


def global_module_hooks() -> List[dict]:
    """The hooks registered for every module's calls (``register_module_forward_hook``, ...), by
    handle id: they fire at each submodule call, and the fast kernel makes none."""
    return list(map(getattr, repeat(_module_globals), _GLOBAL_HOOK_DICTS, repeat({})))  # read at every tiled call


def _module_hooks(module: nn.Module) -> tuple:
    """Forward, forward-pre and (full) backward hooks registered on this one module."""
    return tuple(hook for name in MODULE_HOOK_DICTS for hook in getattr(module, name, {}).values())


def foreign_child_hooks(module: nn.Module, is_backend_hook=no_hook_is_backend) -> List[str]:
    """The hooks on submodules below ``module`` that a tiled call would not run as untiled, by name.

    The fast kernel calls no submodule (not the projections, not ``act_fn``), so any hook on them
    would never fire; the generic path would run them once per shard. A backend's own parameter hooks
    (ZeRO-3 gather/release) are stood in for by the strategy's ``gathered`` inside the tiled call.
    Hooks on ``module`` itself fire once around the tiled call, as untiled.
    """
    found = [f"every module: {getattr(h, '__qualname__', type(h).__name__)}"
             for hooks in global_module_hooks() for h in hooks.values() if not is_backend_hook(h)]
    for name, sub in module.named_modules():
        if not name:
            continue
        # A forward replaced on the instance (accelerate's offload/device hooks do this) is a hook too, unless
        # it is the backend's own (Hugging Face's tensor-parallel styles replace a Linear's forward).
        if "forward" in sub.__dict__ and not is_backend_hook(sub.__dict__["forward"]):
            found.append(f"{name}: a replaced forward")
        found.extend(f"{name}: {getattr(h, '__qualname__', type(h).__name__)}"
                     for h in _module_hooks(sub) if not is_backend_hook(h))
    return found


_LINEAR = CodeForm("return F.linear({x}, self.weight, self.bias)", {"F": F})
_LINEAR_READS = ("weight", "bias")


def _is_plain_linear(module, is_backend_hook=no_hook_is_backend) -> bool:
    # Hooks are checked for every submodule by ``foreign_child_hooks``; the code of the class's forward
    # here (the fast kernel computes ``F.linear`` with the same tensors). A forward on the instance is
    # allowed only where it is the backend's own around the class's (its local view stands in for it).
    own = module.__dict__.get("forward")
    return (type(module) is nn.Linear and (own is None or is_backend_hook(own)) and matches(nn.Linear.forward, _LINEAR)
            and linear_is_a_linear(F.linear))


def _has_dropout(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


def _beyond_spec(module: nn.Module, spec: GatedMLPSpec, act_module) -> str:
    """What the module holds besides the spec's projections and activation ("" when nothing).

    The fast kernel computes from the spec's tensors alone, so anything else the module owns (a
    learnable gain, a side branch, a buffer) could change the result and would get no gradient:
    the structure must rule it out; a numerical probe cannot (such extras are often neutral at init).
    """
    wanted = {id(p) for p in spec.params}
    extra = [name for name, p in module.named_parameters() if id(p) not in wanted]
    if extra:
        return f"parameters besides the projections' ({', '.join(extra)})"
    buffers = [name for name, _ in module.named_buffers()]
    if buffers:
        return f"buffers ({', '.join(buffers)})"
    allowed = {id(m) for m in spec.linears} | {id(act_module)}
    subs = [name for name, m in module.named_modules() if name and id(m) not in allowed]
    if subs:
        return f"submodules besides the projections and the activation ({', '.join(subs)})"
    tensors = [f"{prefix}{'.' if prefix else ''}{key}" for prefix, m in module.named_modules()
               for key, value in vars(m).items() if isinstance(value, torch.Tensor)]
    if tensors:
        return f"tensor attributes outside its parameters ({', '.join(tensors)})"
    return ""


def structural_spec(module: nn.Module, form: GatedForm, is_backend_hook=no_hook_is_backend,
                    forward_code: Optional[CodeRead] = None) -> Tuple[Optional[GatedMLPSpec], str]:
    """The spec if the module's structure lets the fast kernel compute ``form``, else None and why not;
    ``forward_code``: the module's forward and the registered body it matched (None: a registered class)."""
    hooks = foreign_child_hooks(module, is_backend_hook)
    if hooks:
        return None, f"submodules have hooks that the fast kernel would skip ({', '.join(hooks)})"
    problem = check_attributes(module, form)
    if problem:
        return None, problem
    parts = module._modules
    act_module = parts[form.activation]
    act, act_reads, act_code = activation_reads(act_module)
    if act is None:
        return None, f"{form.activation} ({type(act_module).__name__}) is not a recognised activation (silu, gelu, gelu tanh)"
    scales = [resolve_scale(module, s) for s in (form.gate_scale, form.up_scale, form.down_scale)]
    if None in scales:
        return None, f"a scale it multiplies by ({', '.join(form.scale_names)}) is not a plain number"
    gate_scale, up_scale, down_scale = (float(s) for s in scales if s is not None)
    spec = GatedMLPSpec(activation=act, down=parts[form.down],  # type: ignore[arg-type]
                        gate=None if form.gate is None else parts[form.gate],  # type: ignore[arg-type]
                        up=None if form.up is None else parts[form.up],  # type: ignore[arg-type]
                        gate_up=None if form.gate_up is None else parts[form.gate_up],  # type: ignore[arg-type]
                        gate_scale=gate_scale, up_scale=up_scale, down_scale=down_scale, form=form)
    if not all(_is_plain_linear(m, is_backend_hook) for m in spec.linears):
        return None, "projections are not plain nn.Linear (LoRA or quantised wrappers)"
    if any(shadowed(m, _LINEAR_READS) for m in spec.linears):
        return None, "nn.Linear's class defines weight or bias, or a custom attribute lookup, which its forward would read"
    called = (*map(type, spec.linears), type(act_module))
    if not all(map(called_as_torch_calls, called)):
        return None, "a submodule's class is called through a patched __call__, which the fast kernel (calling no submodule) would skip"
    if _has_dropout(module):
        return None, "the module has dropout"
    if spec.gate_up is not None and spec.gate_up.out_features % 2:
        return None, "gate_up_proj has an odd number of outputs"
    extra = _beyond_spec(module, spec, act_module)
    if extra:
        return None, f"the module has {extra}"
    dtypes = {p.dtype for p in spec.params}
    if len(dtypes) > 1:
        return None, f"the projections' weights have different dtypes ({sorted(map(str, dtypes))})"
    spec.proof_reads = ProofReads(((type(module), form.read_names), (type(act_module), act_reads),
                                   *((type(linear), _LINEAR_READS) for linear in spec.linears)),
                                  called=called,
                                  codes=(forward_code, act_code, (nn.Linear.forward, _LINEAR)), torch_functions=True)
    return spec, ""
