"""Which forwards compute ``down(act(gate(x) * gs) * (up(x) * us)) * ds``, and under which names.

A forward qualifies by what it *is*, never by running it: a registered body its bytecode equals
(``register_gated_form``; the integrations register the libraries' bodies), or a class a user registered
(``register_gated_mlp``). Activations are recognised the same way (``recognised_activation``). Anything else
takes the generic path, which runs the module's own forward.
"""
from __future__ import annotations

import functools
import operator
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch.nn.functional as F
from torch import nn

from .code_forms import CodeForm, first_match, replace_body
from .kernel_registry import GENERATION
from .kernels.gated import ACTIVATIONS

Scale = Union[float, str]  # a fixed factor, or the name of a float attribute the forward multiplies by


@dataclass(frozen=True)
class GatedForm:
    """Where a gated MLP keeps its parts (attribute names) and which fixed factors its forward applies."""

    down: str = "down_proj"
    gate: Optional[str] = "gate_proj"
    up: Optional[str] = "up_proj"
    gate_up: Optional[str] = None  # a fused [gate; up] projection instead of gate and up
    activation: str = "act_fn"
    gate_scale: Scale = 1.0  # multiplies gate(x) before the activation
    up_scale: Scale = 1.0  # multiplies up(x)
    down_scale: Scale = 1.0  # multiplies down's output


# Registered bodies (``register_gated_form``) and classes (the forward function, kept alive, and each
# class's registered function). Every change counts in ``kernel_registry.GENERATION``.
KNOWN_BODIES: List[Tuple[CodeForm, GatedForm]] = []
_REGISTERED: Dict[Any, GatedForm] = {}
_REGISTERED_BY_CLASS: Dict[type, Any] = {}


def register_gated_form(body: CodeForm, form: GatedForm) -> None:
    """Declare that a forward whose code is exactly ``body`` (``{x}`` for its argument) computes ``form``.
    Registering a body again replaces its form."""
    if not isinstance(form, GatedForm):
        raise TypeError(f"register_gated_form takes a GatedForm, got {type(form).__name__}")
    if (form.gate_up is None) == (form.gate is None or form.up is None):
        raise ValueError("a form names either gate and up, or gate_up (a fused [gate; up] projection), not both")
    replace_body(KNOWN_BODIES, body, form, "register_gated_form")


def unregister_gated_form(body: CodeForm) -> None:
    replace_body(KNOWN_BODIES, body)


def register_gated_mlp(cls: type, *, gate: Optional[str] = "gate_proj", up: Optional[str] = "up_proj",
                       down: str = "down_proj", gate_up: Optional[str] = None, activation: str = "act_fn",
                       gate_scale: Scale = 1.0, up_scale: Scale = 1.0, down_scale: Scale = 1.0) -> GatedForm:
    """Declare that ``cls.forward`` computes ``down(act(gate(x) * gate_scale) * (up(x) * up_scale)) *
    down_scale`` (``gate_up``: one fused projection whose output is ``[gate | up]``). The declaration holds
    for the forward function ``cls`` has now, not for one patched on the class later. A scale is a number or
    the name of a float attribute of the module. The parts must be plain ``nn.Linear`` children and a
    recognised activation, or the call takes the generic path."""
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_gated_mlp takes an nn.Module subclass, got {cls!r}")
    if (gate_up is None) == (gate is None or up is None):
        raise ValueError("name either gate and up, or gate_up (a fused [gate; up] projection), not both")
    for scale in (gate_scale, up_scale, down_scale):
        if not isinstance(scale, (int, float, str)) or isinstance(scale, bool):
            raise TypeError(f"a scale is a number or an attribute name, got {scale!r}")
    form = GatedForm(down=down, gate=None if gate_up else gate, up=None if gate_up else up, gate_up=gate_up,
                     activation=activation, gate_scale=gate_scale, up_scale=up_scale, down_scale=down_scale)
    unregister_gated_mlp(cls)
    _REGISTERED[cls.forward] = form
    _REGISTERED_BY_CLASS[cls] = cls.forward
    return form


def unregister_gated_mlp(cls: type) -> None:
    _REGISTERED.pop(_REGISTERED_BY_CLASS.pop(cls, None), None)
    GENERATION[0] += 1


def known_form(fn: Any) -> Optional[GatedForm]:
    """The form the plain function ``fn`` (a class's forward) is known to compute, or None."""
    registered = _REGISTERED.get(fn) if fn is not None else None
    return registered if registered is not None else first_match(KNOWN_BODIES, fn)


# Torch's functions as this process first saw them: a monkeypatched ``F.silu`` is not the activation the
# fast kernel differentiates, so a form calling it does not qualify.
F_SILU, F_GELU, F_LINEAR = F.silu, F.gelu, F.linear
# Functions that replace ``F.linear`` process-wide and still compute it, by module and name
# (``register_equivalent_linear``); accepted only as that module's own function object, looked up at each check.
_EQUIVALENT_LINEARS: Set[Tuple[str, str]] = set()


def register_equivalent_linear(module_name: str, function_name: str) -> None:
    """Declare that ``module_name.function_name``, installed as ``F.linear`` by a library, computes torch's
    linear (same result and gradients), so the fast kernel's own ``F.linear`` may stand in for it."""
    if not (isinstance(module_name, str) and isinstance(function_name, str) and module_name and function_name):
        raise TypeError(f"register_equivalent_linear takes a module name and a function name, got "
                        f"{module_name!r}, {function_name!r}")
    _EQUIVALENT_LINEARS.add((module_name, function_name))
    GENERATION[0] += 1


def unregister_equivalent_linear(module_name: str, function_name: str) -> None:
    _EQUIVALENT_LINEARS.discard((module_name, function_name))
    GENERATION[0] += 1


def linear_is_a_linear(fn: Any) -> bool:
    """Whether ``fn`` (what ``F.linear`` is now) computes torch's linear."""
    if fn is F_LINEAR:
        return True
    module_name, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    if (module_name, name) not in _EQUIVALENT_LINEARS:
        return False
    return getattr(sys.modules.get(module_name or ""), name or "", None) is fn


# Activation bodies (``register_activation``): the body -> (what it computes, or None; the instance attribute
# holding its torch function, or None).
_ACTIVATION_BODIES: List[Tuple[CodeForm, Tuple[Optional[str], Optional[str]]]] = []


def register_activation(body: CodeForm, *, computes: Optional[str] = None,
                        function_attribute: Optional[str] = None) -> None:
    """Declare that an activation module whose class's forward has exactly the code of ``body`` computes
    ``computes`` (one of ``ACTIVATIONS``), or calls the function it holds in the instance attribute
    ``function_attribute`` (recognised when it is ``F.silu``, ``F.gelu`` or ``partial(F.gelu,
    approximate="tanh")``, or the ``approximate`` string ``F.gelu`` takes). Name exactly one of the two."""
    if (computes is None) == (function_attribute is None):
        raise ValueError("name either what the activation computes or the attribute holding its function, not both")
    if computes is not None and computes not in ACTIVATIONS:
        raise ValueError(f"unknown activation {computes!r}; known: {', '.join(ACTIVATIONS)}")
    if function_attribute is not None and not function_attribute.isidentifier():
        raise ValueError(f"not an attribute name: {function_attribute!r}")
    replace_body(_ACTIVATION_BODIES, body, (computes, function_attribute), "register_activation")


def unregister_activation(body: CodeForm) -> None:
    replace_body(_ACTIVATION_BODIES, body)


def _function_name(value: Any) -> Optional[str]:
    if isinstance(value, str):  # nn.GELU's ``approximate``
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(value)
    if value is F_SILU:
        return "silu"
    if value is F_GELU:
        return "gelu"
    if (isinstance(value, functools.partial) and value.func is F_GELU and not value.args
            and value.keywords == {"approximate": "tanh"}):
        return "gelu_tanh"
    return None


def recognised_activation(act: Any) -> Tuple[Optional[str], Tuple[str, ...]]:
    """("silu", "gelu" or "gelu_tanh" when ``act`` provably computes it, else None; the instance attributes of
    ``act`` that this read: the one holding its function, where its body names one)."""
    if not isinstance(act, nn.Module) or "forward" in act.__dict__:
        return None, ()
    computes, attribute = first_match(_ACTIVATION_BODIES, type(act).forward) or (None, None)
    if attribute is None:
        return computes, ()
    name = None if shadowed(act, (attribute,)) else _function_name(act.__dict__.get(attribute))
    return name, (attribute,)


# Torch's own activations, known to the core alone.
register_activation(CodeForm("return F.silu({x}, inplace=self.inplace)", {"F": F, "F.silu": F_SILU}), computes="silu")
register_activation(CodeForm("return F.gelu({x}, approximate=self.approximate)", {"F": F, "F.gelu": F_GELU}),
                    function_attribute="approximate")


# How torch's modules find attributes and are called, as this process first saw them.
_TORCH_CALLS = (nn.Module.__call__, nn.Module._call_impl, nn.Module._wrapped_call_impl)
_TORCH_LOOKUP = (object.__getattribute__, nn.Module.__getattr__)
_lookup_of = operator.attrgetter("__getattribute__", "__getattr__")
_calls_of = operator.attrgetter("__call__", "_call_impl", "_wrapped_call_impl")


def called_as_torch_calls(cls: type) -> bool:
    """Whether calling an instance of ``cls`` runs torch's own ``nn.Module.__call__`` (hooks, then forward)."""
    return _calls_of(cls) == _TORCH_CALLS


def shadowed(module: nn.Module, names: Tuple[str, ...]) -> bool:
    """Whether reading one of ``names`` on ``module`` could find something other than what the instance holds
    itself (a class attribute or property of that name, or a custom attribute lookup)."""
    cls = type(module)
    return _lookup_of(cls) != _TORCH_LOOKUP or not all([vars(klass).keys().isdisjoint(names) for klass in cls.__mro__])
