"""The forward bodies transformers writes for its gated MLPs (Llama's, shared by ~140 classes, written three ways;
Llama 4's, Phi3's fused gate_up, Falcon-H1's multipliers), activations and RMSNorms, registered with the core at
import: the core compares a forward's bytecode with each body compiled here, so a patched forward never matches."""
from __future__ import annotations

import torch
from torch import nn

from tiled_mlp.core.code_forms import CodeForm
from tiled_mlp.core.gated_forms import F_SILU, GatedForm, register_activation, register_gated_form
from tiled_mlp.core.norm_forms import MULTIPLY_IN_FLOAT32, MULTIPLY_IN_INPUT_DTYPE, NormForm, register_norm_form

LLAMA = GatedForm()
LLAMA_BODIES = (
    CodeForm("down_proj = self.down_proj(self.act_fn(self.gate_proj({x})) * self.up_proj({x}))\nreturn down_proj"),
    CodeForm("return self.down_proj(self.act_fn(self.gate_proj({x})) * self.up_proj({x}))"),
    CodeForm("gate = self.act_fn(self.gate_proj({x}))\nreturn self.down_proj(gate * self.up_proj({x}))"),
)
LLAMA4 = GatedForm(activation="activation_fn")
LLAMA4_BODY = CodeForm(
    "down_proj = self.activation_fn(self.gate_proj({x})) * self.up_proj({x})\nreturn self.down_proj(down_proj)")
PHI3 = GatedForm(gate=None, up=None, gate_up="gate_up_proj", activation="activation_fn")
PHI3_BODY = CodeForm("up_states = self.gate_up_proj({x})\ngate, up_states = up_states.chunk(2, dim=-1)\n"
                     "up_states = up_states * self.activation_fn(gate)\nreturn self.down_proj(up_states)")
FALCON_H1 = GatedForm(gate_scale="gate_multiplier", down_scale="down_multiplier")
FALCON_H1_BODY = CodeForm("y = self.up_proj({x}) * self.act_fn(self.gate_proj({x}) * self.gate_multiplier)\n"
                          "y = self.down_proj(y) * self.down_multiplier\nreturn y")

# ``transformers.activations``: the body names ``nn`` as that module imports it (``from torch import nn``).
SILU_ACTIVATION_BODY = CodeForm("return nn.functional.silu({x})", {"nn": nn, "nn.functional.silu": F_SILU})
CALLS_ITS_FUNCTION_BODY = CodeForm("return self.act({x})")

# What the norm bodies load from the module's globals: torch itself, and the functions and dtype they read on
# it (a monkeypatched ``torch.rsqrt`` is not what the kernel computes).
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


def register_hf_forms() -> None:
    for body in LLAMA_BODIES:
        register_gated_form(body, LLAMA)
    register_gated_form(LLAMA4_BODY, LLAMA4)
    register_gated_form(PHI3_BODY, PHI3)
    register_gated_form(FALCON_H1_BODY, FALCON_H1)
    register_activation(SILU_ACTIVATION_BODY, computes="silu")
    register_activation(CALLS_ITS_FUNCTION_BODY, function_attribute="act")
    register_norm_form(LLAMA_NORM_BODY, LLAMA_NORM)
    register_norm_form(GEMMA_NORM_BODY, GEMMA_NORM)


register_hf_forms()
