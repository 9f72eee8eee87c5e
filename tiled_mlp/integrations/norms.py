"""Which RMSNorms ``apply_tiled_mlp(norms=True)`` tiles: an ``RMSNorm`` class with no submodule and one 1-D weight of
the model's hidden size (so not Qwen3's per-head q_norm/k_norm). A model whose hidden size is unknown gets none."""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import nn

from tiled_mlp.core import TiledMLP

NORM_ACCUM_DTYPE = torch.float32  # a norm's weight gradient sums every token: never in bf16 (it is hidden floats)


class TiledNorm(TiledMLP):
    tiled_no_fast_path = "it is a norm, not a gated MLP"


def hidden_size(model: nn.Module) -> Optional[int]:
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
    if not (isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")):
        return False
    if next(module.children(), None) is not None:
        return False
    params = list(module.parameters())
    # The full shape: ZeRO-3 keeps it in ``ds_shape`` beside an empty local tensor.
    return len(params) == 1 and tuple(getattr(params[0], "ds_shape", None) or params[0].shape) == (hidden,)


def norm_names(model: nn.Module) -> List[str]:
    """The norms to tile, none within a tiled block (it is tiled with that)."""
    hidden = hidden_size(model)
    if hidden is None:
        return []
    modules = dict(model.named_modules())
    blocks = [name for name, module in modules.items() if isinstance(module, TiledMLP)]
    return [name for name, module in modules.items()
            if name and not any(name == b or name.startswith(b + ".") for b in blocks)
            and is_norm(module, hidden)]


def why_no_norms(model: nn.Module) -> str:
    hidden = hidden_size(model)
    if hidden is None:
        return ("the model's hidden size is unknown (no embedding width, no config.hidden_size), so no RMSNorm is "
                "tiled rather than every one")
    if any(isinstance(module, TiledMLP) and is_norm(module, hidden) for module in model.modules()):
        return ""
    return "no RMSNorm of the hidden size outside the tiled blocks"
