"""The gated activations live with the gated kernel (``kernels/gated.py``); these names stay importable from
here for their other users (the forms' proof, the call plan, the Liger integration)."""
from .kernels.gated import (
    _FUSED,
    ACTIVATIONS,
    FusedKernel,
    NativeGatedActivation,
    fused_generation,
    gated_activation,
    register_fused_kernel,
    unregister_fused_kernel,
)

__all__ = ["_FUSED", "ACTIVATIONS", "FusedKernel", "NativeGatedActivation", "fused_generation", "gated_activation",
           "register_fused_kernel", "unregister_fused_kernel"]
