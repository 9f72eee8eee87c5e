"""Hugging Face's causal LM loss kept in float64, for the untiled side of a float64 comparison.

``ForCausalLMLoss`` casts the logits to float32 (``logits.float()``), so an untiled float64 model's loss is
rounded to float32 while the tiled loss stays float64. Set as the untiled model's ``loss_function``, this
runs the same function with ``Tensor.float`` the identity around that one call. Never set on a tiled model:
its tiled loss refuses a loss function other than transformers' own.
"""
from __future__ import annotations

from typing import Any
from unittest import mock

import torch


def float64_causal_lm_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
    from transformers.loss.loss_utils import ForCausalLMLoss

    with mock.patch.object(torch.Tensor, "float", lambda self: self):
        return ForCausalLMLoss(*args, **kwargs)
