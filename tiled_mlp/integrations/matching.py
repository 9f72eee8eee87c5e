"""Finding a model's MLP blocks by structure (gated Linear-like children, or transformers' fused experts), so no list
of architectures is kept. A whole MoE block is never tiled: its router would run inside the shard loop, which
builds no graph, and the load-balancing loss would lose its gradient."""
from __future__ import annotations

import fnmatch
import inspect
import typing
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Union

import torch
from torch import nn

from tiled_mlp.core import TiledInputs, TiledMLP

from .report import TiledBlock, TilingReport

GATED_LAYOUTS = (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj"))

Patterns = Union[None, str, Iterable[str]]
FUSED_EXPERTS_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")
# The experts' weights are 3-D parameters, not gated Linears: the gated fast kernel never applies.
FUSED_EXPERTS = "its weights are not gated nn.Linear projections (fused MoE experts)"


class TiledExperts(TiledMLP):
    """Tiles a fused experts module in place: same call, same parameters and names."""

    tiled_no_fast_path = FUSED_EXPERTS

    def tiled_inputs(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> TiledInputs:
        # The routing is sharded with the hidden states: each shard's rows keep their own experts and weights.
        return TiledInputs(hidden_states, token_inputs=(top_k_index, top_k_weights), check_hidden=False)


@dataclass
class Candidate:
    name: str
    module: nn.Module
    ancestors: List[nn.Module]  # root first
    kind: str  # "gated", "experts" (fused MoE experts), "named" (an include pattern alone), "norm"


def _is_linear_like(module) -> bool:
    # nn.Linear, and wrappers that keep its interface (PEFT LoRA layers, quantised Linears).
    return isinstance(module, nn.Module) and all(
        isinstance(getattr(module, attr, None), int) for attr in ("in_features", "out_features")
    )


def structural_kind(module: nn.Module) -> Optional[str]:
    if any(all(_is_linear_like(getattr(module, name, None)) for name in layout) for layout in GATED_LAYOUTS):
        return "gated"
    try:
        names = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return "experts" if names == FUSED_EXPERTS_INPUTS else None


def call_problem(module: nn.Module) -> str:
    """Why ``TiledMLP(module)(x)`` could not stand in for ``module(x)``; "" when it can."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return "" if callable(getattr(module, "forward", None)) else "no forward"
    params = list(signature.parameters.values())
    if not params:
        return "forward takes no input"
    extra = [p.name for p in params[1:]]
    if params[0].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) or extra:
        shown = ", ".join(p.name for p in params)
        return f"forward({shown}) takes more than one input; TiledMLP passes the hidden states alone"
    if _returns_tuple(module, signature):
        return "forward returns a tuple; the generic path needs one tensor (tile its experts or add an adapter)"
    return ""


def _returns_tuple(module: nn.Module, signature: inspect.Signature) -> bool:
    annotation = signature.return_annotation
    if annotation is inspect.Signature.empty:
        return False
    if isinstance(annotation, str):
        try:
            annotation = typing.get_type_hints(type(module).forward).get("return", annotation)
        except Exception:  # unresolvable forward references: judge by the text
            return annotation.replace(" ", "").lower().startswith(("tuple", "typing.tuple"))
    return annotation is tuple or typing.get_origin(annotation) is tuple


def _as_patterns(patterns: Patterns) -> Optional[List[str]]:
    if patterns is None:
        return None
    if isinstance(patterns, str):
        return [patterns]
    out = list(patterns)
    if not all(isinstance(p, str) for p in out):
        raise TypeError(f"include/exclude take glob patterns (str or a list of str), got {patterns!r}")
    return out


def _matches(name: str, patterns: Optional[List[str]]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns or ())


def scan(model: nn.Module, report: TilingReport, include: Patterns = None, exclude: Patterns = None,
         norms: Sequence[str] = ()) -> List[Candidate]:
    """Every module to tile, each once (a block reached from two parents is one module); the blocks tiled already
    and those skipped go to ``report``. ``include`` narrows the structural matches and also selects modules no rule
    finds; ``norms`` names norms to tile (kind "norm")."""
    include_patterns, exclude_patterns = _as_patterns(include), _as_patterns(exclude)
    candidates: List[Candidate] = []
    seen = set()

    # Depth first, in the modules' order, with a stack: a nested function calling itself would be a reference cycle
    # that keeps the model alive after ``del model`` until the garbage collector runs.
    stack = _children_of(model, "", [])
    while stack:
        child, name, chain = stack.pop()
        if isinstance(child, TiledMLP):
            report.already_tiled.append(TiledBlock(name, "tiled", child))
            continue
        kind = structural_kind(child)
        if include_patterns is not None:
            kind = (kind or "named") if _matches(name, include_patterns) else None
        if kind is None and name in norms:
            kind = "norm"
        if kind is not None and _matches(name, exclude_patterns):
            report.skipped.append((name, "excluded by pattern"))
            continue
        if kind is not None:
            problem = "" if kind == "experts" else call_problem(child)
            if not problem:
                if id(child) not in seen:
                    seen.add(id(child))
                    candidates.append(Candidate(name, child, chain, kind))
                continue
            report.skipped.append((name, problem))
        stack.extend(_children_of(child, name + ".", chain))
    return sorted(candidates, key=lambda candidate: candidate.kind == "norm")  # the report lists the norms last


def _children_of(parent: nn.Module, prefix: str, ancestors: Sequence[nn.Module]) -> list:
    """``parent``'s children as (child, qualified name, its ancestors), last first: popped in order."""
    chain = [*ancestors, parent]
    return [(child, f"{prefix}{attr}", chain) for attr, child in reversed(list(parent.named_children()))]
