"""What a value read answers on the meta device, where tensors have shapes and no values.

Reading a meta tensor (``bool(t)``, ``t.item()``) raises. The model's own step never reads one (the
planner has always modelled it on the meta device), but the tiled loss checks its labels before any
work (``bool(bad.any())``: labels outside the vocabulary). In the planner's step every such read
answers 0 (False): the answer of a check for a problem the planner's inputs do not have (its input
ids, and so its labels, are zeros: ``step.py``). Answered where the read reaches the dispatcher
(``aten._local_scalar_dense``, whatever the code that asks is called), and only for meta tensors: the
measured CPU step reads its real values, and a read whose 0 sent the modelled step elsewhere than the
real one would show in the byte-exact checks against that step (``tests/planner/test_planner_loss.py``).
"""
from __future__ import annotations

from typing import Union

import torch

_READ = torch.ops.aten._local_scalar_dense.default


def is_meta_read(func, args: tuple) -> bool:
    return func is _READ and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta"


def zero_read(tensor: torch.Tensor) -> Union[bool, int, float, complex]:
    """The 0 of the tensor's kind, as ``item()`` returns it."""
    if tensor.dtype == torch.bool:
        return False
    if tensor.is_complex():
        return 0j
    return 0.0 if tensor.is_floating_point() else 0
