"""DeepSpeed AutoTP (training tensor parallelism, ``"tensor_parallel": {"autotp_size": N}``): claimed, and
refused before any work.

``deepspeed.initialize`` replaces a model's ``nn.Linear`` layers by its own classes
(``deepspeed.module_inject.layers``): ``LinearLayer`` (column-parallel: the weight's output rows split over
the TP ranks, the input gradient all-reduced in backward) and ``LinearAllreduce`` (row-parallel: the input
columns split, the output all-reduced in forward); ``lm_head`` becomes a ``LinearLayer`` that gathers the
vocabulary-sharded logits (or a ``VocabParallelLinear`` that keeps them sharded).

Why an MLP built of them is refused: the generic kernel runs the MLP's own forward once per shard, so
``LinearAllreduce`` all-reduces each shard's output. The tiled forward then checks that no tensor made
inside a shard outlives it (``core/sharded_autograd.py``, ``_check_nothing_kept``), and a synchronous
gloo ``all_reduce`` returns while the communication thread still holds the tensor it reduced: measured
in 2 gloo processes, the reduced tensor was still alive right after the call in 45 of 300 calls, so the
check refuses some calls and not others (a rank that raises while the other goes on to the next shard's
all-reduce deadlocks). The numbers themselves were exact where the call ran (docs/backends.md). Under DTensor
tensor parallelism the same check waits for the backend to let go (``core/collectives.py``), because it sees
the collective: DTensor all-reduces through torch's functional collective ops, which the tiled call's torch
function mode is handed. ``LinearAllreduce`` calls ``torch.distributed.all_reduce``, a process-group method
that no function mode sees, so nothing tells its reduced tensor from one a hook kept. The fast kernel declines
these layers by class (they are not ``nn.Linear``), so it cannot stand in.

Why a head built of them is refused: it holds only this rank's rows of the vocabulary, and the tiled
loss reads the vocabulary size from the weight it is given.

Every rank holds the same layer classes, so every rank refuses at the same point: no collective is left
waiting. deepspeed is never imported here: the layers are recognised by their class's qualified name.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from torch import nn

from .base import Strategy, UnsupportedBackendError, process_group_ready
from .deepspeed_sp import is_instance_of

AUTOTP_LAYER_CLASS = ("deepspeed.module_inject.layers", "TensorParallel_Layer")

MLP_ERROR = (
    "TiledMLP does not compose with DeepSpeed AutoTP: {module}'s {layers} are AutoTP tensor-parallel layers. "
    "The tiled call runs the module once per shard, so LinearAllreduce's all-reduce runs inside every shard, and "
    "the communication backend still holds the reduced tensor for a while after a synchronous all_reduce returns: "
    "the tiled forward's check that no shard's tensor outlives its shard would fail on some calls and not others "
    "(one rank raising while another waits in the next all-reduce): that all_reduce is a process-group call, which "
    "the tiled call cannot see as a collective, as it sees DTensor's. Use DTensor tensor parallelism "
    "(parallelize_module), which composes; or leave these blocks untiled "
    "(apply_tiled_mlp(model, exclude=...)), or train with tensor_parallel.autotp_size 1"
)
HEAD_ERROR = (
    "tiled loss: lm_head is DeepSpeed AutoTP's {layer}, which holds only this rank's rows of the vocabulary "
    "(weight {local} here): the tiled loss reads the vocabulary from the weight it is given, so it would size "
    "and check the vocabulary wrongly. Compute the loss from the model's logits, or train with "
    "tensor_parallel.autotp_size 1"
)


def autotp_layers(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, layer) for ``module`` itself and each descendant that is an AutoTP tensor-parallel layer."""
    return [(name, sub) for name, sub in module.named_modules() if is_instance_of(sub, AUTOTP_LAYER_CLASS)]


class DeepSpeedAutoTPStrategy(Strategy):
    """Claims a module holding AutoTP layers (ahead of the ZeRO strategy, which claims the same engine's
    modules) so that ``check_supported`` refuses it; nothing else is asked of it."""

    name = "deepspeed_autotp"
    priority = 210

    @classmethod
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        return process_group_ready() and bool(autotp_layers(module))

    def check_supported(self, module: nn.Module) -> None:
        layers = autotp_layers(module)
        if not layers:
            return
        if layers[0][1] is module:  # the module is a layer itself: a loss's head
            weight = getattr(module, "weight", None)
            local = tuple(weight.shape) if weight is not None else "absent"
            raise UnsupportedBackendError(HEAD_ERROR.format(layer=type(module).__name__, local=local))
        named = ", ".join(f"{name} ({type(layer).__name__})" for name, layer in layers)
        raise UnsupportedBackendError(MLP_ERROR.format(module=type(module).__name__, layers=named))
