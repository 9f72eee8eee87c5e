"""Relative error of each method's loss, dx and dW against the untiled Hugging Face loss, in the same
run, on one small float32 case.

float32, not float64: ``ForCausalLMLoss`` computes in float32 whatever the logits' dtype
(``logits.float()``), so a float64 reference would still be a float32 one. Correct methods land near
float32 rounding (1e-7); DeepSpeed's TiledFusedLogitsLoss under ArcticTraining's "sum, then divide by N"
accumulates dW inside forward with an incoming gradient of 1 and scales only dx in backward, so its dW
comes out N times too large: a relative error of N - 1.
"""
from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

import torch

from .loss_methods import LossMethod, make_case, run_step


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def gradient_errors(methods: Mapping[str, LossMethod], tokens: int, hidden: int, vocab: int,
                    deepspeed_shards: int, seed: int = 0,
                    on_method: Optional[Callable[[str], None]] = None, device: str = "cpu") -> Dict[str, Dict[str, float]]:
    """{method: {"loss": ..., "dx": ..., "dW": ...}} relative to ``untiled`` (whose own errors are 0)."""
    head, x, labels = make_case(tokens, hidden, vocab, torch.float32, seed, device)
    results: Dict[str, tuple] = {}
    for name, method in methods.items():
        step = method.make(head, deepspeed_shards) if name == "deepspeed" else method.make(head)
        loss = run_step(step, head, x, labels)
        assert x.grad is not None and head.weight.grad is not None, f"{name} gave no dx or no dW"
        results[name] = (loss, x.grad.clone(), head.weight.grad.clone())
        if on_method is not None:
            on_method(name)
    reference = results["untiled"]
    return {name: {key: _relative(a, b) for key, a, b in zip(("loss", "dx", "dW"), got, reference, strict=True)}
            for name, got in results.items()}
