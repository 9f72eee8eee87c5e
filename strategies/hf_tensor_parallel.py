"""Hugging Face's own tensor parallelism (``from_pretrained(..., tp_plan="auto")``): the one seam that reads it.
transformers 5.25 replaces each parallelized module's forward with a closure ``tp_forward`` (no hook) whose
styles compute what torch's do; recognised by what it is, on ``CHECKED_VERSIONS`` only (docs/backends.md).
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Optional, Tuple

from torch import nn

from .checked_versions import checked_on, in_any, installed

CHECKED_VERSIONS = ("5.25.0",)
_TP_MODULE = "transformers.distributed.tensor_parallel"
# What each style's instance holds (``__init__``): anything else on it (a method set on the instance) is not proven.
_STYLE_FIELDS = frozenset(("input_layouts", "output_layouts", "use_local_output"))
_STYLE_METHODS = ("transform_inputs_pre_forward", "transform_output_post_forward", "context_around_forward",
                  "should_use_local_tensors", "install_forward")

VERSION_ERROR = (
    "tensor parallelism: Hugging Face's tensor parallelism (from_pretrained(..., tp_plan=...)) laid out {where} "
    "under transformers {version}; the tiled kernels are checked against its layouts on "
    "transformers {checked} only (its styles replace each Linear's forward there; other versions lay models out "
    "otherwise). Use transformers {checked}, or leave this module untiled"
)


def version_checked() -> bool:
    """The installed transformers is of a minor series checked (a patch release keeps its layouts)."""
    return in_any(checked_on("transformers", CHECKED_VERSIONS), installed("transformers"))


@functools.cache
def _parts_of(tp: Any) -> Optional[Tuple[Any, type, type]]:
    install = tp.TensorParallelLayer.install_forward
    codes = [c for c in install.__code__.co_consts if getattr(c, "co_name", "") == "tp_forward"]
    return (codes[0], tp.ColwiseParallel, tp.RowwiseParallel) if len(codes) == 1 else None


def _tp_parts() -> Optional[Tuple[Any, type, type]]:
    """(tp_forward's code object, HF's ColwiseParallel, RowwiseParallel) on a checked version, else None."""
    tp = sys.modules.get(_TP_MODULE)
    return None if tp is None or not version_checked() else _parts_of(tp)


def _cells(forward: Any) -> Optional[dict]:
    parts = _tp_parts()
    code = getattr(forward, "__code__", None)
    if parts is None or code is None or code is not parts[0]:
        return None
    return dict(zip(code.co_freevars, (cell.cell_contents for cell in forward.__closure__ or ()), strict=True))


def installed_style(module: nn.Module) -> Any:
    """The HF style instance whose ``tp_forward`` is ``module``'s forward, proven or not (to name it), else None."""
    cells = _cells(vars(module).get("forward"))
    return None if cells is None or cells.get("module") is not module else cells.get("self")


def proven_style(module: nn.Module) -> Optional[Tuple[str, Any, Any]]:
    """("colwise" or "rowwise", the style, its mesh) where HF's ColwiseParallel or RowwiseParallel, proven, is the
    forward of ``module``, a plain ``nn.Linear`` whose weight is a DTensor on the style's mesh; else None."""
    cells = _cells(vars(module).get("forward"))
    if cells is None or cells.get("module") is not module:
        return None
    _, colwise, rowwise = _tp_parts()  # type: ignore[misc]  # _cells found them
    style: Any = cells.get("self")
    mesh, original = cells.get("mesh"), cells.get("original_forward")
    kind = {colwise: "colwise", rowwise: "rowwise"}.get(type(style))
    if kind is None or set(vars(style)) != _STYLE_FIELDS:
        return None
    # The style class's methods are transformers' own (not replaced on the class by another library).
    methods = [getattr(type(style), name, None) for name in _STYLE_METHODS]
    if any(getattr(method, "__module__", None) != _TP_MODULE for method in methods):
        return None
    if type(module) is not nn.Linear or getattr(module, "_hf_quantized_needs_local_tp", False):
        return None
    if getattr(original, "__func__", None) is not nn.Linear.forward or getattr(original, "__self__", None) is not module:
        return None
    from torch.distributed.tensor import DTensor

    weight = module._parameters.get("weight")
    if not isinstance(weight, DTensor) or weight.device_mesh != mesh:
        return None
    return kind, style, mesh


def is_hf_tensor_parallel_forward(forward: Any) -> bool:
    cells = _cells(forward)
    module = None if cells is None else cells.get("module")
    return isinstance(module, nn.Module) and vars(module).get("forward") is forward and proven_style(module) is not None


def version_problem(module: nn.Module) -> str:
    """Why ``module`` cannot be tiled: HF's tensor parallelism laid it out (``_is_hooked``) under an unchecked version."""
    if version_checked() or "transformers" not in sys.modules:
        return ""
    hooked = [name or type(module).__name__ for name, sub in module.named_modules() if vars(sub).get("_is_hooked")]
    if not hooked:
        return ""
    return VERSION_ERROR.format(where=", ".join(hooked[:4]) + (", ..." if len(hooked) > 4 else ""),
                                version=installed("transformers"), checked=", ".join(CHECKED_VERSIONS))
