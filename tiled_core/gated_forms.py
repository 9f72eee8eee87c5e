"""Which forwards compute ``down(act(gate(x) * gs) * (up(x) * us)) * ds``, and under which names.

A forward qualifies by what it *is*, never by running it: a registered body whose bytecode it equals
(``register_gated_form``, ``code_forms``; the integrations register the libraries' bodies), or a class a user
registered (``register_gated_mlp``: the forward function the class has at registration). Anything else takes
the generic path, which runs the module's own forward. Activations are recognised the same way
(``activation_name``): torch's ``nn.SiLU``/``nn.GELU`` by class and code, others by ``register_activation``.
"""
from __future__ import annotations

import functools
import operator
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch.nn.functional as F
from torch import nn

from .code_forms import CodeForm, check_body, globals_hold, matches
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

    # Cached on the (frozen) form: the staleness check of a cached fast decision reads them at every call.
    @functools.cached_property
    def module_names(self) -> Tuple[str, ...]:
        names = (self.gate_up,) if self.gate_up is not None else (self.gate, self.up)
        return tuple(n for n in (*names, self.down, self.activation) if n is not None)

    @functools.cached_property
    def scale_names(self) -> Tuple[str, ...]:
        return tuple(s for s in (self.gate_scale, self.up_scale, self.down_scale) if isinstance(s, str))

    @functools.cached_property
    def read_names(self) -> Tuple[str, ...]:
        """Every attribute of the module the forward reads: its parts and its named scales."""
        return self.module_names + self.scale_names


# Forward bodies known to compute a form, in registration order (``register_gated_form``).
KNOWN_BODIES: List[Tuple[CodeForm, GatedForm]] = []

# Registered classes: the forward function object -> its form (kept alive, so no id is reused), and
# each class's registered function. ``_GENERATION`` counts changes to every table in this file:
# the call plan keys on it (``tiled_call``).
_REGISTERED: Dict[Any, GatedForm] = {}
_REGISTERED_BY_CLASS: Dict[type, Any] = {}
_GENERATION = [0]


def _changed() -> None:
    _GENERATION[0] += 1


def register_gated_form(body: CodeForm, form: GatedForm) -> None:
    """Declare that a forward whose code is exactly ``body`` (a method body, ``{x}`` for its argument)
    computes ``form``: tiled modules whose class's forward has that code may take the gated fast
    kernel. Registering a body again replaces its form."""
    if not isinstance(body, CodeForm):
        raise TypeError(f"register_gated_form takes a CodeForm body, got {type(body).__name__}")
    if not isinstance(form, GatedForm):
        raise TypeError(f"register_gated_form takes a GatedForm, got {type(form).__name__}")
    if (form.gate_up is None) == (form.gate is None or form.up is None):
        raise ValueError("a form names either gate and up, or gate_up (a fused [gate; up] projection), not both")
    check_body(body)
    unregister_gated_form(body)
    KNOWN_BODIES.append((body, form))
    _changed()


def unregister_gated_form(body: CodeForm) -> None:
    """Withdraw ``register_gated_form(body, ...)`` (an equal body)."""
    KNOWN_BODIES[:] = [(known, form) for known, form in KNOWN_BODIES if known != body]
    _changed()


def register_gated_mlp(cls: type, *, gate: Optional[str] = "gate_proj", up: Optional[str] = "up_proj",
                       down: str = "down_proj", gate_up: Optional[str] = None, activation: str = "act_fn",
                       gate_scale: Scale = 1.0, up_scale: Scale = 1.0, down_scale: Scale = 1.0) -> GatedForm:
    """Declare that ``cls.forward`` computes ``down(act(gate(x) * gate_scale) * (up(x) * up_scale)) *
    down_scale`` (``gate_up``: one fused projection whose output is ``[gate | up]``), so that tiled
    instances of ``cls`` may take the gated fast kernel. The declaration is yours: it holds for the
    forward function ``cls`` has now, and a forward patched on the class later is not covered.

    A scale is a number or the name of a float attribute of the module (read at every call). The
    parts must be children named as given: plain ``nn.Linear`` projections and a recognised
    activation (``activation_name``), or the call takes the generic path."""
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
    forward = cls.forward
    _REGISTERED[forward] = form
    _REGISTERED_BY_CLASS[cls] = forward
    return form


def unregister_gated_mlp(cls: type) -> None:
    """Withdraw ``register_gated_mlp(cls, ...)`` (whatever ``cls.forward`` is now)."""
    _REGISTERED.pop(_REGISTERED_BY_CLASS.pop(cls, None), None)
    _changed()


def known_form(fn: Any) -> Optional[GatedForm]:
    """The form the plain function ``fn`` (a class's forward, or the function of a method bound to the
    module itself) is known to compute, or None."""
    return known_form_and_body(fn)[0]


def known_form_and_body(fn: Any) -> Tuple[Optional[GatedForm], Optional[CodeForm]]:
    """``known_form``, and the registered body ``fn``'s code matched (None for a registered class)."""
    if fn is None:
        return None, None
    registered = _REGISTERED.get(fn)
    if registered is not None:
        return registered, None
    for body, form in KNOWN_BODIES:
        if matches(fn, body):
            return form, body
    return None, None


# -- torch's functions ---------------------------------------------------------------------------------
# As this process first saw them: a monkeypatched ``F.silu`` is not the activation the fast kernel
# differentiates (its backward is aten's), so a form calling it does not qualify.
F_SILU, F_GELU, F_LINEAR = F.silu, F.gelu, F.linear


# Functions that replace ``F.linear`` process-wide and still compute ``x @ W.T + b``, by module and
# name (``register_equivalent_linear``); accepted only when they are that module's own function object,
# looked up in ``sys.modules`` at every check (never imported here).
_EQUIVALENT_LINEARS: Set[Tuple[str, str]] = set()


def register_equivalent_linear(module_name: str, function_name: str) -> None:
    """Declare that ``module_name.function_name``, when a library installs it as ``F.linear``, computes
    torch's linear (same result and gradients), so the fast kernel's own ``F.linear`` may stand in for it."""
    if not (isinstance(module_name, str) and isinstance(function_name, str) and module_name and function_name):
        raise TypeError(f"register_equivalent_linear takes a module name and a function name, got "
                        f"{module_name!r}, {function_name!r}")
    _EQUIVALENT_LINEARS.add((module_name, function_name))
    _changed()


def unregister_equivalent_linear(module_name: str, function_name: str) -> None:
    _EQUIVALENT_LINEARS.discard((module_name, function_name))
    _changed()


def linear_is_a_linear(fn: Any) -> bool:
    """Whether ``fn`` (what ``F.linear`` is now) computes torch's linear."""
    if fn is F_LINEAR:
        return True
    module_name, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    if (module_name, name) not in _EQUIVALENT_LINEARS:
        return False
    return getattr(sys.modules.get(module_name or ""), name or "", None) is fn


def torch_functions_intact() -> bool:
    """Whether the torch functions the accepted forms call are still what they were proven to be
    (checked at every call that reuses a cached fast decision: patching one changes no key)."""
    return F.silu is F_SILU and F.gelu is F_GELU and (F.linear is F_LINEAR or linear_is_a_linear(F.linear))


# -- the activation -----------------------------------------------------------------------------------
_TORCH_ACTIVATIONS = {
    nn.SiLU: CodeForm("return F.silu({x}, inplace=self.inplace)", {"F": F, "F.silu": F_SILU}),
    nn.GELU: CodeForm("return F.gelu({x}, approximate=self.approximate)", {"F": F, "F.gelu": F_GELU}),
}


@dataclass(frozen=True)
class ActivationForm:
    """What a module whose forward has a registered body computes: one activation (``computes``), or
    the torch function held in its instance attribute ``function_attribute``."""

    computes: Optional[str] = None
    function_attribute: Optional[str] = None


# Activation bodies (``register_activation``), in registration order.
_ACTIVATION_BODIES: List[Tuple[CodeForm, ActivationForm]] = []


def register_activation(body: CodeForm, *, computes: Optional[str] = None,
                        function_attribute: Optional[str] = None) -> None:
    """Declare that an activation module whose class's forward has exactly the code of ``body``
    computes ``computes`` (one of ``activations.ACTIVATIONS``), or calls the function it holds in the
    instance attribute ``function_attribute`` (recognised when it is torch's ``F.silu``, ``F.gelu`` or
    ``partial(F.gelu, approximate="tanh")``). Name exactly one of the two. Registering a body again
    replaces what it computes."""
    if not isinstance(body, CodeForm):
        raise TypeError(f"register_activation takes a CodeForm body, got {type(body).__name__}")
    if (computes is None) == (function_attribute is None):
        raise ValueError("name either what the activation computes or the attribute holding its function, not both")
    if computes is not None and computes not in ACTIVATIONS:
        raise ValueError(f"unknown activation {computes!r}; known: {', '.join(ACTIVATIONS)}")
    if function_attribute is not None and not function_attribute.isidentifier():
        raise ValueError(f"not an attribute name: {function_attribute!r}")
    check_body(body)
    unregister_activation(body)
    _ACTIVATION_BODIES.append((body, ActivationForm(computes, function_attribute)))
    _changed()


def unregister_activation(body: CodeForm) -> None:
    """Withdraw ``register_activation(body, ...)`` (an equal body)."""
    _ACTIVATION_BODIES[:] = [(known, form) for known, form in _ACTIVATION_BODIES if known != body]
    _changed()


def _function_name(fn: Any) -> Optional[str]:
    """The activation a plain function attribute computes: torch's own functions, by identity."""
    if fn is F_SILU:
        return "silu"
    if fn is F_GELU:
        return "gelu"
    if (isinstance(fn, functools.partial) and fn.func is F_GELU and not fn.args
            and fn.keywords == {"approximate": "tanh"}):
        return "gelu_tanh"
    return None


def activation_name(act: Any) -> Optional[str]:
    """"silu", "gelu" or "gelu_tanh" when ``act`` provably computes it, else None."""
    return activation_reads(act)[0]


CodeRead = Tuple[Any, CodeForm]  # a forward function and the body its code matched


def activation_reads(act: Any) -> Tuple[Optional[str], Tuple[str, ...], Optional[CodeRead]]:
    """What ``act`` provably computes (as ``activation_name``), the attributes its forward reads by name
    (what its class must not shadow), and its forward with the body it matched (whose globals must hold),
    for as long as the answer is relied on."""
    if not isinstance(act, nn.Module) or "forward" in act.__dict__:
        return None, (), None
    cls = type(act)
    forward = cls.forward
    torch_form = _TORCH_ACTIVATIONS.get(cls)
    reads: Tuple[str, ...]
    if torch_form is not None:
        reads = ("inplace", "approximate")
        if not matches(forward, torch_form) or shadowed(act, reads):
            return None, reads, None
        if cls is nn.SiLU:
            return "silu", reads, (forward, torch_form)
        approximate = act.__dict__.get("approximate")
        name = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate) if isinstance(approximate, str) else None
        return name, reads, (forward, torch_form)
    for body, form in _ACTIVATION_BODIES:
        if not matches(forward, body):
            continue
        if form.computes is not None:
            return form.computes, (), (forward, body)
        reads = (form.function_attribute or "",)
        name = None if shadowed(act, reads) else _function_name(act.__dict__.get(reads[0]))
        return name, reads, (forward, body)
    return None, (), None


# How torch's modules find attributes and are called, as this process first saw them: a lookup or a call
# patched on ``nn.Module`` itself is not torch's.
TORCH_MODULE_GETATTR = nn.Module.__getattr__
_TORCH_CALLS = (nn.Module.__call__, nn.Module._call_impl, nn.Module._wrapped_call_impl)
_TORCH_LOOKUP = (object.__getattribute__, TORCH_MODULE_GETATTR)
_lookup_of = operator.attrgetter("__getattribute__", "__getattr__")
_calls_of = operator.attrgetter("__call__", "_call_impl", "_wrapped_call_impl")


def called_as_torch_calls(cls: type) -> bool:
    """Whether calling an instance of ``cls`` runs torch's own ``nn.Module.__call__`` (hooks, then forward),
    not a ``__call__`` patched on the class or on ``nn.Module`` (which a kernel calling no submodule skips)."""
    return _calls_of(cls) == _TORCH_CALLS


class ProofReads:
    """What a decision proven from forwards' code read outside the module tree's own dicts, and whether it still
    holds (strict mode checks it at every call that reuses the decision): no attribute the instances of some
    classes read by name shadowed by a class attribute, property or custom lookup; each called class called
    through torch's own ``__call__``; the module globals of each matched body (``code_forms.globals_hold``);
    and, with ``torch_functions``, the torch functions the forms call (``torch_functions_intact``)."""

    def __init__(self, reads: Iterable[Tuple[type, Tuple[str, ...]]], called: Iterable[type] = (),
                 codes: Iterable[Optional[CodeRead]] = (), torch_functions: bool = False):
        names_by_class: Dict[type, Set[str]] = {}
        for cls, names in reads:
            names_by_class.setdefault(cls, set()).update(names)
        self._reads = [(cls, tuple(names), cls.__mro__) for cls, names in names_by_class.items()]
        self._called = tuple(dict.fromkeys(called))
        self._codes = [code for code in codes if code is not None]
        self._torch_functions = torch_functions

    def holds(self) -> bool:
        return (all(cls.__mro__ == mro and not class_shadows(cls, names) for cls, names, mro in self._reads)
                and all(map(called_as_torch_calls, self._called))
                and all(globals_hold(fn, form) for fn, form in self._codes)
                and (not self._torch_functions or torch_functions_intact()))


def class_shadows(cls: type, names: Tuple[str, ...]) -> bool:
    """Whether reading one of ``names`` on an instance of ``cls`` could find something other than what the
    instance holds itself (a class attribute or property of that name, or a custom attribute lookup). Asked at
    every norm call: a few C passes (a class dict's key view checks the few names, not the dict)."""
    return _lookup_of(cls) != _TORCH_LOOKUP or not all([vars(klass).keys().isdisjoint(names) for klass in cls.__mro__])


def shadowed(module: nn.Module, names: Tuple[str, ...]) -> bool:
    return class_shadows(type(module), names)


def resolve_scale(module: nn.Module, scale: Scale) -> Optional[float]:
    """The factor's value, or None when the named attribute is not a plain number."""
    if not isinstance(scale, str):
        return float(scale)
    if shadowed(module, (scale,)):
        return None
    value = module.__dict__.get(scale)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def check_attributes(module: nn.Module, form: GatedForm) -> str:
    """Why ``module``'s attributes may not be what the form's forward reads ("" when they are)."""
    if shadowed(module, form.read_names):
        return "its class defines an attribute the forward reads, or a custom attribute lookup"
    names = form.module_names
    attributes = module.__dict__
    # An instance attribute of a child's name is found before the child (nn.Module keeps children in
    # ``_modules``, read only when normal lookup fails).
    if not attributes.keys().isdisjoint(names):
        return f"an instance attribute hides the submodule {', '.join(n for n in names if n in attributes)}"
    children = attributes["_modules"]
    missing = [name for name in names if not isinstance(children.get(name), nn.Module)]
    if missing:
        return f"no submodule {', '.join(missing)}"
    return ""

