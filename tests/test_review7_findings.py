"""Review findings on gradient accumulation, mixed precision, PEFT, the strategies and the public API's unusual
arguments (the third review; tests/test_review5_findings.py and tests/test_review6_findings.py hold the first two).

Each test states what the library should do, measured against the same run untiled in float64; while the finding
stands it is a strict xfail whose reason gives the measured numbers, so the suite goes red once it is fixed.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loss_reference import hidden_batch, linear_head, shifted
from torch import nn

from tiled_mlp import tiled_cross_entropy

pytestmark = pytest.mark.timeout(60)


def _scale_linear_outputs(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A global forward hook that rescales every ``nn.Linear``'s output (what an instrumenting tool can do)."""
    return output * 1.5 if isinstance(module, nn.Linear) else output


@pytest.mark.xfail(strict=True, reason=(
    "a global forward hook (torch.nn.modules.module.register_module_forward_hook) is not refused by the tiled loss, "
    "whose check reads only lm_head's own hook dicts (tiled_loss._loss, `foreign`): the hook sees the 0-dim loss as "
    "lm_head's output and rescales the loss, where untiled it rescales the logits. float64, hidden [2, 9, 16], vocab 50, "
    "3 shards: loss 6.4594 tiled (1.5 times the unhooked loss) against 4.6442 untiled (off by 1.815), lm_head gradient off by up to 0.031"))
def test_a_global_forward_hook_on_the_head_is_refused_or_sees_the_logits():
    hidden, labels = hidden_batch()
    want_head, head = linear_head(), linear_head()
    handle = nn.modules.module.register_module_forward_hook(_scale_linear_outputs)
    try:
        logits = want_head(hidden)
        want = F.cross_entropy(logits.flatten(0, 1), shifted(labels).flatten(), ignore_index=-100)
        want.backward()
        try:
            got = tiled_cross_entropy(hidden, head, labels, num_shards=3)
        except RuntimeError:
            return  # refused before any work, as hooks on the head itself are: acceptable
        got.backward()
    finally:
        handle.remove()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(head.weight.grad, want_head.weight.grad, rtol=0, atol=1e-12)
