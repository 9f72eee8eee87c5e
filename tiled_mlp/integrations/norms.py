"""Which RMSNorms ``apply_tiled_mlp(norms=True)`` tiles: found by class (``torch.nn.RMSNorm``, or a class
named ``...RMSNorm`` as every Hugging Face family names its own) and structure (no submodule, one 1-D
weight of the model's hidden size), so token-wise by construction. Per-head norms (Qwen3's q_norm and
k_norm, of the head size) and norms inside a block tiled already are not among them.

The hidden size is read from the token embeddings (through a PEFT wrapper to its base layer) or the
text config; a model that says neither gets no norm tiled, and says so, rather than every RMSNorm.
Under ZeRO-3 a parameter's local tensor is empty and its shape is ``ds_shape``: that one is judged.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from tiled_mlp.core import TiledMLP

NORM_ACCUM_DTYPE = torch.float32  # a norm's weight gradient sums every token: never in bf16 (it is hidden floats)


class TiledNorm(TiledMLP):
    """Tiles an RMSNorm in place (``apply_tiled_mlp(norms=True)``): same call, same names. Its one input
    is the hidden states, and its output has their width."""

    tiled_no_fast_path = "it is a norm, not a gated MLP"


def hidden_size(model: nn.Module) -> Optional[int]:
    """The width of the model's token embeddings, else its text config's ``hidden_size`` (None: neither)."""
    try:
        embeddings = model.get_input_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError, TypeError):
        embeddings = None
    base = getattr(embeddings, "get_base_layer", None)  # PEFT's LoRA embedding wraps the nn.Embedding
    width = getattr(base() if callable(base) else embeddings, "embedding_dim", None)
    if isinstance(width, int):
        return width
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = getattr(text, "hidden_size", None)
    return width if isinstance(width, int) else None


def is_norm(module: nn.Module, hidden: int) -> bool:
    """An RMSNorm with no submodule and one 1-D weight of ``hidden`` elements."""
    if not (isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")):
        return False
    if next(module.children(), None) is not None:
        return False
    params = list(module.parameters())
    # The full shape: ZeRO-3 keeps it in ``ds_shape`` beside an empty local tensor.
    return len(params) == 1 and tuple(getattr(params[0], "ds_shape", None) or params[0].shape) == (hidden,)


def norm_names(model: nn.Module, inside: Sequence[str] = ()) -> List[str]:
    """The qualified names of the norms to tile: ``is_norm`` at the model's hidden size, none of them
    within a tiled block or within the blocks named in ``inside`` (about to be tiled: a norm inside an
    MLP is tiled with it). Empty when the hidden size is unknown (``hidden_size``)."""
    hidden = hidden_size(model)
    if hidden is None:
        return []
    modules = dict(model.named_modules())
    blocks = [name for name, module in modules.items() if isinstance(module, TiledMLP)] + list(inside)
    return [name for name, module in modules.items()
            if name and not any(name == b or name.startswith(b + ".") for b in blocks if b)
            and is_norm(module, hidden)]


def why_no_norms(model: nn.Module) -> str:
    """What the report says when ``norm_names`` is empty ('': the norms are tiled already)."""
    hidden = hidden_size(model)
    if hidden is None:
        return ("the model's hidden size is unknown (no embedding width, no config.hidden_size), so no RMSNorm is "
                "tiled rather than every one")
    if any(isinstance(module, TiledMLP) and is_norm(module, hidden) for module in model.modules()):
        return ""
    return "no RMSNorm of the hidden size outside the tiled blocks"
