"""One answer from DeepSpeed's CPU accelerator on every CPU, so that a DeepSpeed test passing here passes
on the next machine.

``CPU_Accelerator.is_fp16_supported()`` asks mkldnn, which says yes on CPUs with AVX512-FP16 / AMX-FP16
and no elsewhere, and DeepSpeed branches on it: ZeRO-3's ``zero.Init`` keeps the module's dtype (and
asserts it is half, bfloat16 or float32) where fp16 is supported, and silently takes bfloat16 as its dtype
where it is not. A float64 ZeRO-3 engine thus runs on one machine and asserts on another. The suite pins the
answer to yes, the stricter branch, in the test process and in every spawned rank.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_MODULE = "deepspeed.accelerator.cpu_accelerator"


class _PinFp16Support(importlib.abc.MetaPathFinder):
    """Patches the accelerator class as its module is first imported (importing DeepSpeed here would cost
    every test process seconds, DeepSpeed or not)."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_pin(module):
            exec_module(module)
            module.CPU_Accelerator.is_fp16_supported = lambda self: True

        spec.loader.exec_module = exec_and_pin  # type: ignore[method-assign]
        return spec


def pin_fp16_support() -> None:
    if _MODULE in sys.modules:
        sys.modules[_MODULE].CPU_Accelerator.is_fp16_supported = lambda self: True
    elif not any(isinstance(finder, _PinFp16Support) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PinFp16Support())
