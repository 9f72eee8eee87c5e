"""Which forwards compute an RMSNorm, and how: proven by what the forward *is* (a registered body,
``code_forms``), never by running it. A body may call methods of its own class (Gemma's ``self._norm``):
each is proven by its own registered body (``NormForm.helpers``). The formula, in the body's dtypes:

    n = x.to(float32) * rsqrt(x.to(float32).pow(2).mean(-1, keepdim=True) + eps)
    MULTIPLY_IN_INPUT_DTYPE:  y = (offset + w) * n.to(x.dtype)            (Llama: offset 0)
    MULTIPLY_IN_FLOAT32:      y = (n * (offset + w.float())).to(x.dtype)   (Gemma: offset 1)
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from torch import nn

from .code_forms import CodeForm, check_body, first_match, matches, replace_body
from .gated_forms import shadowed
from .kernels.rms_norm import MULTIPLIES, MULTIPLY_IN_INPUT_DTYPE, NormLayout, RMSNormShardKernel
from .kernels.rms_norm import MULTIPLY_IN_FLOAT32 as MULTIPLY_IN_FLOAT32  # for NormForm, with the other one


@dataclass(frozen=True)
class NormForm:
    """Where an RMSNorm keeps its weight and eps (attribute names), the constant added to the weight, the
    dtype the weight multiplies in, and the methods of its class the body calls on ``self`` (name, body)."""

    weight: str = "weight"
    eps: str = "variance_epsilon"
    offset: float = 0.0
    multiply: str = MULTIPLY_IN_INPUT_DTYPE
    helpers: Tuple[Tuple[str, CodeForm], ...] = ()


_BODIES: List[Tuple[CodeForm, NormForm]] = []


def register_norm_form(body: CodeForm, form: NormForm) -> None:
    """Declare that a forward whose code is exactly ``body`` computes ``form``, so tiled instances of its
    class may take the norm kernel. Registering a body again replaces its form."""
    if not isinstance(form, NormForm):
        raise TypeError(f"register_norm_form takes a NormForm, got {type(form).__name__}")
    if form.multiply not in MULTIPLIES:
        raise ValueError(f"NormForm.multiply is one of {MULTIPLIES}, got {form.multiply!r}")
    if not (form.weight.isidentifier() and form.eps.isidentifier()):
        raise ValueError(f"NormForm names attributes: weight={form.weight!r}, eps={form.eps!r}")
    if isinstance(form.offset, bool) or not isinstance(form.offset, (int, float)):
        raise TypeError(f"NormForm.offset is a number, got {form.offset!r}")
    for name, helper in form.helpers:
        if not name.isidentifier():
            raise ValueError(f"a helper is named by a method name, got {name!r}")
        check_body(helper, "a NormForm helper")
    replace_body(_BODIES, body, form, "register_norm_form")


UNKNOWN_NORM = ("its forward is not one the norm kernel is known to compute (a registered RMSNorm body, "
                "tiled_mlp.core.norm_forms.register_norm_form)")


def norm_spec(module: nn.Module, forward_fn: Optional[Any]) -> Tuple[Optional[RMSNormShardKernel], str]:
    """(the norm kernel for it, "") when ``forward_fn`` (what the module's forward runs, None: not a function of
    this module) provably computes a registered norm on this module's attributes, else (None, why not)."""
    form = first_match(_BODIES, forward_fn)
    if form is None:
        return None, UNKNOWN_NORM
    if shadowed(module, (form.weight, form.eps)):
        return None, f"its class defines {form.weight} or {form.eps}, or a custom attribute lookup, which the forward reads"
    attributes = module.__dict__
    for name, helper in form.helpers:
        if name in attributes:
            return None, f"an instance attribute replaces the method {name}"
        if not matches(inspect.getattr_static(type(module), name, None), helper):
            return None, f"its method {name} is not the one the form's body calls (patched or edited)"
    if next(iter(attributes["_modules"]), None) is not None:
        return None, "it has submodules (a norm has none: their hooks would not run)"
    weight = attributes["_parameters"].get(form.weight)
    if not isinstance(weight, nn.Parameter) or form.weight in attributes:
        return None, f"{form.weight} is not a Parameter of the module"
    if [p for p in attributes["_parameters"].values() if p is not None] != [weight]:
        return None, f"it has parameters besides {form.weight}"
    if weight.dim() != 1:
        return None, f"{form.weight} is {weight.dim()}-D (a norm's weight is [hidden])"
    eps = attributes.get(form.eps)
    if type(eps) is not float:
        return None, f"{form.eps} is not a plain float ({type(eps).__name__})"
    return RMSNormShardKernel(NormLayout(eps, float(form.offset), form.multiply), weight, type(module).__name__), ""
