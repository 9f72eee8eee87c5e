"""DeepSpeed ZeRO-3's replacement of ``F.linear``, registered with the core as computing torch's linear.

ZeRO-3 installs its memory-efficient linear as ``torch.nn.functional.linear`` at initialisation, "and
this will persist unless manually reset" (``deepspeed.runtime.zero.partition_parameters``). It computes
``x @ W.T + b`` and its gradients as torch's linear does (an autograd Function of its own), so the
gated fast kernel, which calls torch's ``F.linear`` itself, may stand in for a forward that would call it. The core accepts it only while it
is that module's own function object, looked up by name; deepspeed is not imported.
"""
from __future__ import annotations

from tiled_mlp.core.gated_forms import register_equivalent_linear

ZERO3_LINEAR = ("deepspeed.runtime.zero.linear", "zero3_linear_wrap")

register_equivalent_linear(*ZERO3_LINEAR)
