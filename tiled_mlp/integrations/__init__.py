"""Integrations with model libraries. Nothing here imports transformers, peft or accelerate at import
time; the helpers that build models import transformers when called.

Importing this package registers with the core what it knows of other libraries (``hf_forms``:
Hugging Face's gated MLP, activation and RMSNorm bodies; ``deepspeed_linear``: ZeRO-3's ``F.linear``;
``liger_activation``: Liger-Kernel's fused activations on CUDA), so every use through ``tiled_mlp``
has them; the core alone knows only torch's own modules, functions and kernels."""
from . import deepspeed_linear, hf_forms, liger_activation  # noqa: F401  (registrations made at import)
from .args import TiledMLPFlags, add_tiled_mlp_args, read_tiled_mlp_flags
from .causal_lm_loss import is_tiled_loss, remove_tiled_loss, set_tiled_loss_label_smoothing
from .hf import (
    apply_from_flags,
    apply_tiled_loss,
    apply_tiled_mlp,
    enable_tiled_mlp,
    from_config,
    from_pretrained,
    is_tiled,
    maybe_apply_tiled_mlp,
    remove_tiled_mlp,
)
from .offload import apply_checkpoint_offload
from .report import TiledBlock, TilingReport
from .stack import LongContextStack, apply_long_context
from .trainer_label_smoothing import use_tiled_label_smoothing
from .ulysses import SequenceParallel, apply_sequence_parallel

__all__ = [
    "apply_long_context", "LongContextStack", "apply_checkpoint_offload", "apply_sequence_parallel",
    "SequenceParallel", "apply_tiled_mlp", "remove_tiled_mlp", "apply_tiled_loss", "remove_tiled_loss",
    "is_tiled_loss", "set_tiled_loss_label_smoothing", "use_tiled_label_smoothing", "is_tiled", "enable_tiled_mlp",
    "maybe_apply_tiled_mlp", "from_config", "from_pretrained", "TilingReport", "TiledBlock", "add_tiled_mlp_args",
    "read_tiled_mlp_flags", "apply_from_flags", "TiledMLPFlags",
]
