"""Tensor parallelism in the modelled step: torch's DTensor TP, applied as torchtitan applies it to a Llama.

A rank of a TP group of ``tp`` runs the whole sequence with its share of each decoder layer: ``parallelize_module``
puts ``ColwiseParallel`` on the query, key, value, gate and up projections (each rank computes ``heads / tp``
attention heads and ``intermediate / tp`` MLP channels) and ``RowwiseParallel`` on the output and down
projections (their partial sums all-reduced, so the hidden states between the TP regions are whole on every
rank), and ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` on the LM head, whose logits stay
divided by the vocabulary and meet the model's own cross-entropy under ``loss_parallel()``. The sharded weights,
their gradients and so their optimizer state are ``1 / tp`` on the rank; the embeddings and the RMSNorms are
whole. Every buffer of that (the DTensor ops' local results, the all-reduces' outputs, the vocabulary-parallel
loss's) is what torch's own code allocates: the modelled step runs ``parallelize_module``'s modules, not a
formula. A tiled setting puts the library's tiling on after the plan (``step.build_model``), as a user calls
``apply_tiled_mlp`` on a parallelized model: the tiled MLPs run the fast kernel's local view of the rank's shares
(``strategies/tensor_parallel.py``), the tiled loss is the vocabulary-parallel one
(``strategies/tensor_parallel_head.py``), the tiled norms see the whole hidden states between the TP regions.

On the meta device, in one process: the mesh is a ``DeviceMesh`` of ``tp`` over a ``FakeProcessGroup`` (torch's
group whose collectives do nothing), registered under a name of the planner's own in c10d's registry of groups by
name, the registry DTensor's collectives look a group up in; the modelled rank is rank 0. torch.distributed's
default process group is never initialised nor read, so a plan can run inside a distributed job. On meta the one
ops whose kernels differ from a device's are two of the functional collectives': ``_wrap_tensor_autograd`` (on a
device it wraps the all-reduce's output in an ``AsyncCollectiveTensor``, no memory of its own) and ``wait_tensor``
(on a device it returns its input), whose meta kernels return a fresh ``empty_like``; the step's tracker gives
them the device's answer (``device_answers``). A real
step passes its own mesh (``integration_tests/test_planner_tp_honesty.py``: two gloo ranks, byte-exact against the
modelled step).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Callable, Dict, Iterator

import torch
from torch import nn

from .heads import check_degree, head_counts
from .timeline import stored_in

_NAMES = itertools.count()
# The submodules each decoder layer shards, by the style torchtitan gives them for a Llama.
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
# Meshes the planner made, kept while a model built on them lives (the fake group must outlive its DTensors).
_MESHES: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
_GROUPS: Dict[Any, Any] = {}  # name -> FakeProcessGroup: one per degree, registered once per process


def check_ranks(tp: int, sp: int, world_size: int, backend: Any, parser_error) -> None:
    """What --tp asks together with --sp, --world-size and --backend, refused through ``parser_error`` where it is
    not modelled: TP is one dimension of the ranks, the backend shards over the other (FSDP2, as torchtitan)."""
    if tp < 1:
        parser_error(f"--tp must be 1 or more, got {tp}")
    if tp == 1:
        return
    if sp > 1:
        parser_error(f"--tp {tp} with --sp {sp}: tensor and Ulysses sequence parallelism together are not modelled; "
                     "give one of them")
    if world_size % tp:
        parser_error(f"--tp {tp}: tensor parallelism runs on groups of {tp} ranks; --world-size {world_size} is not a "
                     f"multiple of {tp}")
    if backend in ("ddp", "zero3"):
        parser_error(f"--tp {tp} with --backend {backend} is not modelled: the data-parallel ranks of a DTensor TP "
                     "model are modelled with fsdp2 (as torchtitan shards them), or single where --world-size is --tp")


def check(config, tp: int) -> None:
    """A ValueError when ``tp`` ranks cannot share ``config``'s layers as ``parallelize_module`` divides them."""
    check_degree("--tp", tp, "tensor")
    if tp == 1:
        return
    text = config.get_text_config()
    heads, kv_heads = head_counts(config)
    if heads % tp or kv_heads % tp:
        raise ValueError(f"--tp {tp}: {config.model_type} has {heads} query and {kv_heads} key/value heads; "
                         f"ColwiseParallel gives each rank whole heads only when {tp} divides both")
    if text.intermediate_size % tp:
        raise ValueError(f"--tp {tp}: the MLP's {text.intermediate_size} channels do not split across {tp} ranks")
    if getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False):
        raise ValueError(f"--tp {tp}: {config.model_type} ties its LM head to its embeddings; the TP plan modelled "
                         "shards the LM head by the vocabulary and keeps the embeddings whole, which a tied weight "
                         "cannot be (not modelled)")


def _layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"tensor parallelism is modelled for a causal LM whose decoder layers are model.layers; "
                         f"{type(model).__name__} has none")
    return layers


def refusal(model: nn.Module) -> str:
    """Why the TP plan cannot be put on ``model`` ('' when it can): every decoder layer must hold the Llama
    projections as ``nn.Linear``s (an MoE layer's experts are not planned), and the LM head one too."""
    try:
        layers = _layers(model)
    except ValueError as error:
        return str(error)
    for index, layer in enumerate(layers):
        for name in COLUMN + ROW:
            try:
                module = layer.get_submodule(name)
            except AttributeError:
                return (f"decoder layer {index} ({type(layer).__name__}) has no {name}: the TP plan modelled is "
                        "torchtitan's Llama plan (q/k/v/gate/up column-wise, o/down row-wise)")
            if type(module) is not nn.Linear:
                return (f"decoder layer {index}'s {name} is a {type(module).__name__}, not an nn.Linear: the TP "
                        "plan modelled is torchtitan's, on the Linear projections")
    if type(getattr(model, "lm_head", None)) is not nn.Linear:
        return f"{type(model).__name__}.lm_head is not an nn.Linear: the vocabulary-parallel LM head is not modelled"
    return ""


def apply(model: nn.Module, mesh: Any) -> nn.Module:
    """torchtitan's TP plan for a Llama put on ``model`` over the 1-D ``mesh``, in place."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    why = refusal(model)
    if why:
        raise ValueError(why)
    plan: Dict[str, Any] = {name: ColwiseParallel() for name in COLUMN}
    plan.update({name: RowwiseParallel() for name in ROW})
    for layer in _layers(model):
        parallelize_module(layer, mesh, plan)
    # The logits stay divided by the vocabulary (a DTensor), for ``loss_parallel``'s cross-entropy.
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    _MESHES[model] = mesh
    return model


def is_parallel(model: nn.Module) -> bool:
    return model in _MESHES


def meta_mesh(tp: int) -> Any:
    """A 1-D ``DeviceMesh`` of ``tp`` ranks over a ``FakeProcessGroup``, this process its rank 0, made without
    torch.distributed's default group (``DeviceMesh.from_group`` would look the group's ranks up there)."""
    from torch._C._distributed_c10d import FakeProcessGroup
    from torch.distributed import HashStore, ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.distributed_c10d import GroupName, _register_process_group, _resolve_process_group

    name = GroupName(f"tiled_mlp_planner_tp{tp}")
    if name not in _GROUPS:
        # A process group whose backend is the fake one, put together as ``init_process_group`` puts one
        # together for backend "fake", without making it the default group.
        group = ProcessGroup(HashStore(), 0, tp)
        group._set_default_backend(ProcessGroup.BackendType.CUSTOM)
        for device in ("cpu", "meta"):
            group._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM,
                                    FakeProcessGroup._create_internal(0, tp))
        group._set_group_name(name)
        _GROUPS[name] = group
    try:
        registered = _resolve_process_group(name)
    except RuntimeError:
        # Not registered yet, or no longer: ``destroy_process_group()`` unregisters every group by name, this
        # one too, after an earlier plan registered it.
        _register_process_group(name, _GROUPS[name])
    else:
        if registered is not _GROUPS[name]:
            raise RuntimeError(f"the planner's fake tensor-parallel group is named {name!r}, and another process group "
                               "is registered under that name: rename that group, or plan in a process of its own")
    mesh = DeviceMesh("cpu", torch.arange(tp), _init_backend=False, _rank=0)
    mesh._dim_group_names = [name]
    mesh._pg_registry[name] = _GROUPS[name]
    return mesh


def device_answers() -> Dict[Any, Callable[[torch.Tensor], Any]]:
    """The functional collectives whose meta kernel allocates what a device's does not, each with the device's
    answer (see the module doc). The step's tracker gives these answers itself on meta."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    ops = torch.ops._c10d_functional
    # A device's wait returns the collective's output itself, once it is complete.
    return {ops._wrap_tensor_autograd.default: AsyncCollectiveTensor, ops.wait_tensor.default: lambda tensor: tensor}


@contextlib.contextmanager
def step_context(model: nn.Module) -> Iterator[None]:
    """What a step of a TP model runs in: the vocabulary-parallel cross-entropy."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield


def local_vocab(model: nn.Module) -> int:
    """The rank's share of the vocabulary: the last dim of its logits."""
    weight = model.get_parameter("lm_head.weight")
    return int(stored_in(weight)[0].shape[0])
