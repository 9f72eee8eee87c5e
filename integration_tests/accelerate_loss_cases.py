"""Rank side of the accelerate tests with the tiled loss: the tiny transformers Llama, tiled by the flags
(``add_tiled_mlp_args`` -> ``apply_from_flags``, as a training script takes them), prepared by accelerate's
own ``Accelerator.prepare`` under FSDP2, DeepSpeed ZeRO-3 or DDP, two SGD steps on different tokens per rank.

Each run records its losses, every parameter's full gradient at each step and every full parameter after
it; the untiled run computes its loss from the logits in float64 by hand (transformers' own loss is float32
math, ``tiny_models``' note), so a float64 run is compared exactly. The test compares the tiled run with the
untiled run prepared the same way and with one process untiled (``tiled_loss_steps.steps_reference_run``).

On CPU accelerate never turns FSDP on by itself (its state says ``MULTI_CPU``): the distributed type and the
plugin are set on its state by hand before ``prepare``, which then runs its real FSDP2 path
(``fsdp2_prepare_model``). DeepSpeed through accelerate on CPU needs ``Accelerator()`` without ``cpu=True``
(with it, accelerate falls back to DDP) and an explicit ``train_batch_size``.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from .tiled_loss_steps import FLAGS, LR, build_loss_model, run_steps, tiled_by_flags


# -- the backends, each through accelerate's prepare --------------------------------------------------
def _fsdp2_accelerator():
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            reshard_after_forward=True)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def _zero3_accelerator():
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2, "gradient_accumulation_steps": 1,
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    assert accelerator.distributed_type == DistributedType.DEEPSPEED
    return accelerator


def _ddp_accelerator():
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU
    return accelerator


def _fsdp2_full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _zero3_grad(p: torch.Tensor) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_grad

    return safe_get_full_grad(p).detach().clone()


def _zero3_param(p: torch.Tensor) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(p).detach().clone()


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


# backend -> (accelerator factory, model dtype, full gradient, full parameter)
BACKENDS: Dict[str, Tuple[Callable, torch.dtype, Callable, Callable]] = {
    "fsdp2": (_fsdp2_accelerator, torch.float64, lambda p: _fsdp2_full(p.grad), _fsdp2_full),
    "zero3": (_zero3_accelerator, torch.float32, _zero3_grad, _zero3_param),  # ZeRO-3 takes no float64
    "ddp": (_ddp_accelerator, torch.float64, lambda p: _plain(p.grad), _plain),
}


def train_accelerate_loss(accelerator, backend: str, tiled: bool, rank: int, tied: bool = False, flags: List[str] = FLAGS) -> Dict:
    """Two steps of the tiny Llama (its head tied to the embeddings or not) prepared by ``accelerator`` for
    ``backend``; the loss tiled by ``flags`` or computed from the logits."""
    from tiled_mlp.integrations.norms import TiledNorm

    _, dtype, full_grad, full_param = BACKENDS[backend]
    model = build_loss_model(dtype, tied)
    if tiled:
        tiled_by_flags(model, flags)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    named = list(accelerator.unwrap_model(model).named_parameters())  # the model's own names
    record = run_steps(model, named, tiled, rank, accelerator.backward, optimizer, full_grad, full_param)
    record["layout"] = describe_layout(accelerator.unwrap_model(model))
    record["final_norm_tiled"] = isinstance(accelerator.unwrap_model(model).model.norm, TiledNorm)
    return record


def describe_layout(model: torch.nn.Module) -> Dict:
    """Which modules share the FSDP2 unit of the output head (empty outside FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    from tiled_mlp.strategies.fsdp2 import unit_modules

    head = model.get_output_embeddings()
    if not isinstance(head, FSDPModule):
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    return {"head_unit": [names[id(m)] for m in unit_modules(head)]}


def one_run(rank: int, world_size: int, backend: str, tiled: bool, tied: bool = False) -> Dict:
    """One run per process: accelerate takes one ``Accelerator`` with a plugin per process, and its ZeRO-3
    ``backward`` stays with the first engine prepared."""
    return train_accelerate_loss(BACKENDS[backend][0](), backend, tiled, rank, tied)
