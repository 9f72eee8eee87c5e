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
GATED_BODIES = (
    ("down_proj = self.down_proj(self.act_fn(self.gate_proj({x})) * self.up_proj({x}))\nreturn down_proj", LLAMA),
    ("return self.down_proj(self.act_fn(self.gate_proj({x})) * self.up_proj({x}))", LLAMA),
    ("gate = self.act_fn(self.gate_proj({x}))\nreturn self.down_proj(gate * self.up_proj({x}))", LLAMA),
    ("down_proj = self.activation_fn(self.gate_proj({x})) * self.up_proj({x})\nreturn self.down_proj(down_proj)",
     GatedForm(activation="activation_fn")),  # Llama 4
    ("up_states = self.gate_up_proj({x})\ngate, up_states = up_states.chunk(2, dim=-1)\n"
     "up_states = up_states * self.activation_fn(gate)\nreturn self.down_proj(up_states)",
     GatedForm(gate=None, up=None, gate_up="gate_up_proj", activation="activation_fn")),  # Phi3
    ("y = self.up_proj({x}) * self.act_fn(self.gate_proj({x}) * self.gate_multiplier)\n"
     "y = self.down_proj(y) * self.down_multiplier\nreturn y",
     GatedForm(gate_scale="gate_multiplier", down_scale="down_multiplier")),  # Falcon-H1
)
for _body, _form in GATED_BODIES:
    register_gated_form(CodeForm(_body), _form)

# ``transformers.activations``: the body names ``nn`` as that module imports it (``from torch import nn``).
register_activation(CodeForm("return nn.functional.silu({x})", {"nn": nn, "nn.functional.silu": F_SILU}),
                    computes="silu")
register_activation(CodeForm("return self.act({x})"), function_attribute="act")

# What the norm bodies load from the module's globals: torch itself, and the functions and dtype they read on
# it (a monkeypatched ``torch.rsqrt`` is not what the kernel computes).
_TORCH = {"torch": torch, "torch.rsqrt": torch.rsqrt, "torch.float32": torch.float32}
register_norm_form(CodeForm(  # Llama's
    "input_dtype = {x}.dtype\n"
    "{x} = {x}.to(torch.float32)\n"
    "variance = {x}.pow(2).mean(-1, keepdim=True)\n"
    "{x} = {x} * torch.rsqrt(variance + self.variance_epsilon)\n"
    "return self.weight * {x}.to(input_dtype)", _TORCH),
    NormForm(weight="weight", eps="variance_epsilon", multiply=MULTIPLY_IN_INPUT_DTYPE))
GEMMA_NORM_HELPER = CodeForm("return {x} * torch.rsqrt({x}.pow(2).mean(-1, keepdim=True) + self.eps)",
                             {"torch": torch, "torch.rsqrt": torch.rsqrt})
register_norm_form(CodeForm(  # Gemma's: (1 + w) in float32, its ``_norm`` proven by its own body
    "output = self._norm({x}.float())\n"
    "output = output * (1.0 + self.weight.float())\n"
    "return output.type_as({x})"),
    NormForm(weight="weight", eps="eps", offset=1.0, multiply=MULTIPLY_IN_FLOAT32, helpers=(("_norm", GEMMA_NORM_HELPER),)))
