"""Recognising a gated MLP (``down(act(gate(x)) * up(x))``) that the fast kernel may compute by hand.

The fast kernel bypasses the module's own forward, so it is used only when the structure proves that
nothing could be lost by that: the projections are plain ``nn.Linear`` (not LoRA or quantised
wrappers) with no hooks, the module owns nothing else (no other parameter, buffer, submodule or
tensor attribute), it has no dropout, and the activation is one we can differentiate exactly. A probe
of the module's real forward then checks its data flow (it reads no other tensor and draws no random
numbers) and its numbers (it computes the formula). Any doubt means the generic path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.nn.modules import module as _module_globals

from .activations import NativeGatedActivation
from .tensor_reads import TensorReads, describe

_ACT_ATTRS = ("act_fn", "activation_fn", "act")
PROBE_TOKENS = 8

# Activation classes by name, so the core never imports transformers; the probe below confirms the math.
_ACTIVATION_BY_CLASS = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "GELUPytorchTanh": "gelu_tanh",
}


@dataclass
class GatedMLPSpec:
    """The tensors of a gated MLP. ``gate_up`` is set for a fused ``[gate; up]`` projection."""

    activation: str
    down: nn.Linear
    gate: Optional[nn.Linear] = None
    up: Optional[nn.Linear] = None
    gate_up: Optional[nn.Linear] = None

    @property
    def linears(self) -> List[nn.Linear]:
        first = [self.gate_up] if self.gate_up is not None else [self.gate, self.up]
        return [linear for linear in (*first, self.down) if linear is not None]

    @property
    def params(self) -> List[torch.Tensor]:
        out = []
        for linear in self.linears:
            out.append(linear.weight)
            if linear.bias is not None:
                out.append(linear.bias)
        return out


def _activation(module: nn.Module) -> Tuple[Optional[object], Optional[str]]:
    """The activation module (or function) and its name, or (None, None)."""
    for attr in _ACT_ATTRS:
        act = getattr(module, attr, None)
        if act is None:
            continue
        if isinstance(act, nn.GELU):
            return act, "gelu_tanh" if act.approximate == "tanh" else "gelu"
        name = _ACTIVATION_BY_CLASS.get(type(act).__name__)
        return (act, name) if name is not None and _activation_matches(act, name) else (None, None)
    return None, None


def _activation_matches(act, name: str) -> bool:
    # Activations hold no weights, so the probe runs on real numbers even inside FakeTensorMode.
    with unset_fake_temporarily():
        probe = torch.linspace(-6.0, 6.0, 49, dtype=torch.float64)
        try:
            with torch.no_grad():
                # ``forward``, not ``__call__``: a backend's hooks on the activation module must not
                # see this probe (other hooks have already ruled the fast path out).
                got = act.forward(probe) if isinstance(act, nn.Module) else act(probe)
        except Exception:
            return False
        want = NativeGatedActivation(name).act(probe)
        return torch.allclose(got.to(torch.float64), want, rtol=1e-6, atol=1e-9)


def _has_values(t: torch.Tensor) -> bool:
    return not (t.is_meta or is_fake(t))


def _no_hook_is_backend(hook) -> bool:
    return False


_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks")


def global_module_hooks() -> List[dict]:
    """The hooks registered for every module's calls (``register_module_forward_hook``, ...), by
    handle id: they fire at each submodule call, and the fast kernel makes none."""
    return [getattr(_module_globals, name, {}) for name in _GLOBAL_HOOK_DICTS]


def _module_hooks(module: nn.Module) -> tuple:
    """Forward, forward-pre and (full) backward hooks registered on this one module."""
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return tuple(hook for name in names for hook in getattr(module, name, {}).values())


def foreign_child_hooks(module: nn.Module, is_backend_hook=_no_hook_is_backend) -> List[str]:
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
        # A forward replaced on the instance (accelerate's offload/device hooks do this) is a hook too.
        if "forward" in sub.__dict__:
            found.append(f"{name}: a replaced forward")
        found.extend(f"{name}: {getattr(h, '__qualname__', type(h).__name__)}"
                     for h in _module_hooks(sub) if not is_backend_hook(h))
    return found


def _is_plain_linear(module) -> bool:
    # Hooks are checked for every submodule by ``foreign_child_hooks``.
    return type(module) is nn.Linear


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


def structural_spec(module: nn.Module, is_backend_hook=_no_hook_is_backend) -> Tuple[Optional[GatedMLPSpec], str]:
    """The spec if the module's structure allows the fast path, else None and the reason why not."""
    hooks = foreign_child_hooks(module, is_backend_hook)
    if hooks:
        return None, f"submodules have hooks that the fast kernel would skip ({', '.join(hooks)})"
    act_module, act = _activation(module)
    if act is None:
        return None, "no recognised gated activation (act_fn / activation_fn: silu, gelu, gelu tanh)"
    down = getattr(module, "down_proj", None)
    if down is None:
        return None, "no down_proj"
    gate_up = getattr(module, "gate_up_proj", None)
    if gate_up is not None:
        spec = GatedMLPSpec(activation=act, down=down, gate_up=gate_up)
    else:
        spec = GatedMLPSpec(activation=act, down=down, gate=getattr(module, "gate_proj", None),
                            up=getattr(module, "up_proj", None))
        if spec.gate is None or spec.up is None:
            return None, "no gate_proj/up_proj or gate_up_proj"
    if not all(_is_plain_linear(m) for m in spec.linears):
        return None, "projections are not plain nn.Linear (LoRA or quantised wrappers)"
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
    return spec, ""


def gated_reference(spec: GatedMLPSpec, x: torch.Tensor) -> torch.Tensor:
    """The formula the fast kernel implements, in plain torch (used for the probe)."""
    act = NativeGatedActivation(spec.activation).act
    if len(spec.linears) == 2:  # fused [gate; up]
        g, u = spec.linears[0](x).chunk(2, dim=-1)
    else:
        g, u = spec.linears[0](x), spec.linears[1](x)
    return spec.down(act(g) * u)


def probe_forward(forward_fn, spec: GatedMLPSpec, like: torch.Tensor) -> str:
    """Why the module's real forward may not be replaced by the gated formula ("" when it may).

    It runs the forward on eight random tokens and checks two things: the data flow (every tensor it
    reads is the input, one of the spec's weights, or made inside: no other weight, buffer, closure
    or attribute tensor, and no random numbers drawn), and the numbers (the output equals the
    formula). Fake and meta weights (memory modelling, ``tiled-mlp plan``) have no values to probe:
    there the structural checks alone decide, since no number computed from them is ever used.
    """
    if not (_has_values(spec.down.weight) and _has_values(like)):
        return ""
    generator = torch.Generator(device="cpu").manual_seed(0)
    in_features = spec.linears[0].in_features
    # Eight tokens over a wide range (std 1 up to 8), so that a clamp or a different activation that
    # agrees near zero still shows.
    scale = torch.logspace(0, 3, PROBE_TOKENS, base=2.0).unsqueeze(-1)
    probe = torch.randn((1, PROBE_TOKENS, in_features), generator=generator, dtype=torch.float32) * scale
    probe = probe.to(device=like.device, dtype=spec.down.weight.dtype)
    reads = TensorReads(known=[probe, *spec.params], grad_only=False)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        with reads:
            got = forward_fn(probe)
        want = gated_reference(spec, probe)
    if reads.random_calls:
        return f"its forward draws random numbers ({', '.join(sorted(set(reads.random_calls)))})"
    if reads.foreign:
        return f"its forward reads tensors besides its input and the projections' weights: {describe(reads.foreign_tensors())}"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "its forward does not return one tensor of the formula's shape"
    # Relative to the output's scale, token by token: a module whose outputs are small cannot pass on
    # an absolute tolerance alone. bf16/fp16 differ by their rounding of the intermediates.
    tol = 1e-5 if probe.dtype in (torch.float32, torch.float64) else 3e-2
    err = (got.float() - want.float()).abs().amax(-1)
    if not bool((err <= tol * want.float().abs().amax(-1).clamp_min(1e-30)).all()):
        return "its forward does not compute down(act(gate(x)) * up(x))"
    return ""
