"""Integrations with model libraries; nothing here imports transformers, peft or accelerate at import time.
Importing this package registers with the core what it knows of other libraries' forms and kernels."""
from tiled_mlp.core.gated_forms import register_equivalent_linear

from . import hf_forms, liger_activation  # noqa: F401  (registrations made at import)
from .args import TiledMLPFlags, add_tiled_mlp_args, read_tiled_mlp_flags
from .causal_lm_loss import is_tiled_loss, remove_tiled_loss, set_tiled_loss_label_smoothing
from .hf import (
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
from .stack import LongContextStack, apply_from_flags, apply_long_context
from .trainer_label_smoothing import use_tiled_label_smoothing
from .ulysses import SequenceParallel, apply_sequence_parallel

__all__ = [
    "apply_long_context", "LongContextStack", "apply_checkpoint_offload", "apply_sequence_parallel",
    "SequenceParallel", "apply_tiled_mlp", "remove_tiled_mlp", "apply_tiled_loss", "remove_tiled_loss",
    "is_tiled_loss", "set_tiled_loss_label_smoothing", "use_tiled_label_smoothing", "is_tiled", "enable_tiled_mlp",
    "maybe_apply_tiled_mlp", "from_config", "from_pretrained", "TilingReport", "TiledBlock", "add_tiled_mlp_args",
    "read_tiled_mlp_flags", "apply_from_flags", "TiledMLPFlags",
]

# ZeRO-3 installs its own ``F.linear`` process-wide (same math, its own autograd Function): the gated fast kernel,
# which calls torch's, may stand in for a forward calling it, while it is that module's own function.
register_equivalent_linear("deepspeed.runtime.zero.linear", "zero3_linear_wrap")
