"""Length-dependent RoPE under Ulysses SP. HF's rotary embedding runs on each rank over its slice of ``position_ids``;
``"dynamic"`` and ``"longrope"`` pick their frequencies from ``max(position_ids) + 1`` (``dynamic_rope_update``),
so a rank whose slice ends early would take the short ones, silently wrong. Each call is given the group's largest
position as one extra position (an all-reduce MAX) and its cos/sin cut off the output: elementwise, so the rank's
own are bit for bit the whole sequence's."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .seams import transformers_internals

# Classified by reading transformers 5.25.0's ``modeling_rope_utils`` (its ``ROPE_INIT_FUNCTIONS`` and
# ``dynamic_rope_update``): ``tests/test_ulysses_rope.py`` fails when a release registers a type not here.
LENGTH_INDEPENDENT = ("default", "linear", "yarn", "llama3", "proportional")
LENGTH_DEPENDENT = ("dynamic", "longrope")

UNKNOWN_FORWARD_ERROR = (
    "sequence parallelism: {module} has the length-dependent rope_type {rope_type!r} (its frequencies follow the "
    "longest position of the call), but its forward is not transformers' dynamic_rope_update, whose rule this "
    "library gives the whole sequence's length under SP; each rank would pick frequencies from its own slice. "
    "Use a transformers release whose {module} forward is decorated with dynamic_rope_update (checked on "
    "5.25.0), or a length-independent rope_type ({independent})."
)
NO_ROTARY_ERROR = (
    "sequence parallelism: {model}'s config asks for the length-dependent rope_type {rope_type!r}, but no rotary "
    "embedding module with that rope_type was found in the model; under SP each rank would pick frequencies from "
    "its own slice. Use a length-independent rope_type ({independent})."
)


def is_length_dependent(rope_type: Any) -> bool:
    # ``dynamic_rope_update``'s rule: these types recompute their frequencies from each call's positions.
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def _rope_types(value: Any) -> List[str]:
    """The rope types ``value`` names: a module's ``rope_type`` (one, or one per layer type) or a config's rope
    parameters (one entry, or one per layer type); their other values are numbers and lists."""
    if isinstance(value, str):
        return [value]
    return [t for item in value.values() for t in _rope_types(item)] if isinstance(value, dict) else []


def length_dependent_rotaries(model: nn.Module) -> List[nn.Module]:
    """The rotary embeddings whose frequencies follow the call's positions; refuses those whose forward is not HF's
    and a config asking for such a type that no module carries. Changes nothing."""
    wrapper = transformers_internals.rope_update_wrapper_code()
    found: List[nn.Module] = []
    for module in model.modules():
        dependent = [t for t in _rope_types(getattr(module, "rope_type", None)) if is_length_dependent(t)]
        if not dependent:
            continue
        forward = getattr(type(module).forward, "__code__", None)
        if forward is not wrapper:
            raise ValueError(UNKNOWN_FORWARD_ERROR.format(module=type(module).__name__, rope_type=dependent[0],
                                                          independent=", ".join(LENGTH_INDEPENDENT)))
        found.append(module)
    config: Any = getattr(model, "config", None)
    if config is not None and not found:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        asked = [t for name in ("rope_parameters", "rope_scaling")
                 for t in _rope_types(getattr(text, name, None)) if is_length_dependent(t)]
        if asked:
            raise ValueError(NO_ROTARY_ERROR.format(model=type(model).__name__, rope_type=asked[0],
                                                    independent=", ".join(LENGTH_INDEPENDENT)))
    return found


def _positions(args: Tuple, kwargs: Dict) -> Tuple[Optional[torch.Tensor], bool]:
    if "position_ids" in kwargs:
        return kwargs["position_ids"], True
    return (args[1] if len(args) > 1 else None), False


def whole_sequence_rope(rotaries: List[nn.Module], group: Any) -> List[Any]:
    """Hooks (returned) giving each call of ``rotaries`` the SP group's largest position as one extra position,
    cut off its output."""
    def add_largest(module: nn.Module, args: Tuple, kwargs: Dict) -> Tuple[Tuple, Dict]:
        positions, by_name = _positions(args, kwargs)
        if not isinstance(positions, torch.Tensor):
            raise ValueError(f"sequence parallelism: {type(module).__name__} was called without position_ids; under SP "
                             "its length-dependent frequencies need the positions of the rank's slice")
        largest = positions.max().reshape(1)
        # Every rank of the group calls its rotary embedding once per forward: the collective is matched.
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        extended = torch.cat([positions, largest.expand(*positions.shape[:-1], 1)], dim=-1)
        if by_name:
            return args, {**kwargs, "position_ids": extended}
        return (args[0], extended, *args[2:]), kwargs

    def cut_largest(module: nn.Module, args: Tuple, kwargs: Dict, output: Any) -> Any:
        positions, _ = _positions(args, kwargs)
        assert isinstance(positions, torch.Tensor)  # add_largest put it there
        tokens = positions.shape[-1] - 1
        parts = output if isinstance(output, tuple) else (output,)
        if not all(isinstance(p, torch.Tensor) and p.dim() >= 2 and p.shape[-2] == tokens + 1 for p in parts):
            raise RuntimeError(f"sequence parallelism: {type(module).__name__} returned {[tuple(p.shape) for p in parts]}"
                               f", not [..., {tokens + 1}, dim] tensors for {tokens + 1} positions; its frequencies "
                               "cannot be given the whole sequence's length here")
        cut = tuple(p[..., :tokens, :] for p in parts)
        return cut if isinstance(output, tuple) else cut[0]

    return [hook for module in rotaries for hook in (module.register_forward_pre_hook(add_largest, with_kwargs=True),
                                                     module.register_forward_hook(cut_largest, with_kwargs=True))]
