"""Length-dependent RoPE under Ulysses SP: every rank takes the whole sequence's frequencies.

Hugging Face's rotary embeddings run once per forward, on each rank before the attention's all-to-all,
over that rank's slice of ``position_ids``. For most RoPE types the frequencies are fixed at construction
and a position's angle depends on the position alone, so a slice gets the same cos/sin as the whole
sequence. Two types pick their frequencies from the call (``transformers.modeling_rope_utils``,
``dynamic_rope_update``, read in 5.25.0): the decorated ``forward`` takes
``seq_len = max(position_ids) + 1`` and

- a ``rope_type`` containing ``"dynamic"`` (dynamic NTK) recomputes ``inv_freq`` for ``seq_len`` when it
  grows past the longest length seen, and resets it below the trained length;
- ``"longrope"`` (Phi-3-128k, Phi-3.5) takes its long factors where ``seq_len`` exceeds
  ``original_max_position_embeddings``, its short ones otherwise.

Every other type registered in ``ROPE_INIT_FUNCTIONS`` (``linear``, ``yarn``, ``llama3``,
``proportional``), and ``default``, is computed once in ``__init__`` without a length
(``LENGTH_INDEPENDENT``). Under SP a rank whose slice ends early (rank 0 always) would take the short or
unscaled frequencies the whole sequence does not: a silent wrong loss and gradients.

The fix keeps Hugging Face's own code: each call of a length-dependent rotary embedding on the SP model is
given one more position, the largest of the whole sequence (an all-reduce MAX of the ranks' largest
positions over the SP group, one integer per forward), so its ``max(position_ids) + 1`` is the whole
sequence's; the extra position's cos/sin are cut off its output. A position's cos/sin is an elementwise
function of that position and the frequencies, so the rank's own positions get bit for bit what the
whole sequence gives them. A rotary embedding whose ``forward`` is not Hugging Face's decorated one
(``dynamic_rope_update``), with a length-dependent type, is refused: what it reads from the call is not
known here.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
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
    """Does ``dynamic_rope_update`` recompute this type's frequencies from each call's positions? Its rule."""
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def _types_of(value: Any) -> List[str]:
    """A ``rope_type`` attribute or config entry: a name, or one per layer type (Gemma 3's dict)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, str)]
    return []


def _config_rope_types(config: Any) -> List[str]:
    """The rope types a (text) config asks for: ``rope_parameters`` (5.x), ``rope_scaling`` (4.x)."""
    found: List[str] = []
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if not isinstance(params, dict):
            continue
        entries = [params] if "rope_type" in params or "type" in params else list(params.values())
        for entry in entries:
            if isinstance(entry, dict):
                found += _types_of(entry.get("rope_type", entry.get("type")))
    return found


def length_dependent_rotaries(model: nn.Module) -> List[nn.Module]:
    """The rotary embeddings of ``model`` whose frequencies follow the call's positions; refuses those it
    cannot give the whole sequence's length (see the module docstring), and a config that asks for a
    length-dependent type no module carries. Changes nothing."""
    wrapper = transformers_internals.rope_update_wrapper_code()
    found: List[nn.Module] = []
    for module in model.modules():
        dependent = [t for t in _types_of(getattr(module, "rope_type", None)) if is_length_dependent(t)]
        if not dependent:
            continue
        forward = getattr(type(module).forward, "__code__", None)
        if wrapper is None or forward is not wrapper:
            raise ValueError(UNKNOWN_FORWARD_ERROR.format(module=type(module).__name__, rope_type=dependent[0],
                                                          independent=", ".join(LENGTH_INDEPENDENT)))
        found.append(module)
    config: Any = getattr(model, "config", None)
    if config is not None and not found:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        asked = [t for t in _config_rope_types(text) if is_length_dependent(t)]
        if asked:
            raise ValueError(NO_ROTARY_ERROR.format(model=type(model).__name__, rope_type=asked[0],
                                                    independent=", ".join(LENGTH_INDEPENDENT)))
    return found


def _positions(args: Tuple, kwargs: Dict) -> Tuple[Optional[torch.Tensor], bool]:
    """The call's ``position_ids`` (``forward(x, position_ids, ...)``) and whether it came by keyword."""
    if "position_ids" in kwargs:
        return kwargs["position_ids"], True
    return (args[1] if len(args) > 1 else None), False


def whole_sequence_rope(rotaries: List[nn.Module], group: Any) -> Callable[[], None]:
    """Hook each of ``rotaries`` (``length_dependent_rotaries``) so that every call sees the SP group's
    largest position as one extra position, cut off its output. Returns what removes the hooks."""
    import torch.distributed as dist

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

    handles = []
    for module in rotaries:
        handles.append(module.register_forward_pre_hook(add_largest, with_kwargs=True))
        handles.append(module.register_forward_hook(cut_largest, with_kwargs=True))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove
