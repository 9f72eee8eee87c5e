"""The forward bodies Hugging Face transformers writes for its RMSNorms, registered with the core when this
package is imported, so that tiled instances take the norm kernel (``tiled_mlp.core.norm_forms``).

Each body is the library's source text, compared as bytecode with the installed forward: a patched or
edited forward (or a kernel from the hub swapped in) never matches, and takes the generic path.

- ``LLAMA_NORM_BODY``: ``self.weight * normed.to(input_dtype)``, shared by ~140 classes (Llama, Mistral,
  Qwen2/3, Phi-3, ...).
- ``GEMMA_NORM_BODY``: ``(normed * (1.0 + self.weight.float())).type_as(x)`` (Gemma, Gemma 2 and 3, ...),
  whose normalisation is the method ``_norm`` (``GEMMA_NORM_HELPER``), proven the same way.
"""
from __future__ import annotations

import torch

from tiled_mlp.core.code_forms import CodeForm
from tiled_mlp.core.norm_forms import MULTIPLY_IN_FLOAT32, MULTIPLY_IN_INPUT_DTYPE, NormForm, register_norm_form

# What the bodies load from the module's globals: torch itself, and the functions and dtype they read on it
# (a monkeypatched ``torch.rsqrt`` is not what the kernel computes).
_TORCH = {"torch": torch, "torch.rsqrt": torch.rsqrt, "torch.float32": torch.float32}

LLAMA_NORM = NormForm(weight="weight", eps="variance_epsilon", multiply=MULTIPLY_IN_INPUT_DTYPE)
LLAMA_NORM_BODY = CodeForm(
    "input_dtype = {x}.dtype\n"
    "{x} = {x}.to(torch.float32)\n"
    "variance = {x}.pow(2).mean(-1, keepdim=True)\n"
    "{x} = {x} * torch.rsqrt(variance + self.variance_epsilon)\n"
    "return self.weight * {x}.to(input_dtype)", _TORCH)

GEMMA_NORM_HELPER = CodeForm("return {x} * torch.rsqrt({x}.pow(2).mean(-1, keepdim=True) + self.eps)",
                             {"torch": torch, "torch.rsqrt": torch.rsqrt})
GEMMA_NORM = NormForm(weight="weight", eps="eps", offset=1.0, multiply=MULTIPLY_IN_FLOAT32,
                      helpers=(("_norm", GEMMA_NORM_HELPER),))
GEMMA_NORM_BODY = CodeForm(
    "output = self._norm({x}.float())\n"
    "output = output * (1.0 + self.weight.float())\n"
    "return output.type_as({x})")


def register_hf_norm_forms() -> None:
    register_norm_form(LLAMA_NORM_BODY, LLAMA_NORM)
    register_norm_form(GEMMA_NORM_BODY, GEMMA_NORM)


register_hf_norm_forms()
