"""What each rank runs for ``test_refusals_tp.py``: tensor-parallel layouts the library refuses, each built the way
a user would get there (torch's ``parallelize_module``, a parameter set on the module afterwards, Hugging Face's
``tp_plan``), and the text of the error each raises (``raised``: ``("", "nothing raised")`` where none was)."""
from __future__ import annotations

from typing import Any, Dict, Tuple
from unittest import mock

import torch
from torch import nn

from . import tp_cases
from .sp_cases import raised
from .tp_cases import tiled_norm_outcome
from .tp_loss_cases import HIDDEN, VOCAB, _case_inputs, _proj_and_head

SEQ = 8


def _sequence_parallel_norm(mesh, sequence_dim: int = 1) -> nn.Module:
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    norm = nn.RMSNorm(HIDDEN, dtype=torch.float64)
    return parallelize_module(norm, mesh, SequenceParallel(sequence_dim=sequence_dim, use_local_output=True))


def norm_refusals(rank: int, world: int) -> Dict[str, str]:
    """A tiled RMSNorm under ``SequenceParallel`` handed an input it cannot compute on: a DTensor on another mesh
    (the style's input hook keeps a DTensor already sharded as it wants, whatever its mesh), and the hidden
    dimension sharded (``sequence_dim=2``, or ``-1``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("other",))  # the same ranks, another mesh
    local = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    on_other_mesh = DTensor.from_local(local, other, [Shard(1)], run_check=False)
    return {"other_mesh": tiled_norm_outcome(_sequence_parallel_norm(mesh), on_other_mesh),
            "hidden_sharded": tiled_norm_outcome(_sequence_parallel_norm(mesh, sequence_dim=2),
                                                 local[..., : HIDDEN // world]),
            "hidden_sharded_as_last": tiled_norm_outcome(_sequence_parallel_norm(mesh, sequence_dim=-1),
                                                         local[..., : HIDDEN // world]),
            # Not a refusal: the token dimension counted from the end is the token dimension.
            "tokens_as_negative": tiled_norm_outcome(_sequence_parallel_norm(mesh, sequence_dim=-2), local)}


def _colwise_head(mesh, bias: bool = False) -> nn.Module:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    head = _proj_and_head(bias)["lm_head"]
    return parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))


def _loss_outcome(head: nn.Module, **kwargs) -> Tuple[str, str]:
    """The tiled loss's error on ``head``, and whether the head's gradients stayed untouched (nothing ran)."""
    from tiled_mlp.core import tiled_cross_entropy

    x, labels = _case_inputs({}, seed=1)
    if "sequence_group" in kwargs:
        kwargs["shift_labels"] = labels
    else:
        kwargs["labels"] = labels
    kind, message = raised(lambda: tiled_cross_entropy(x, head, num_shards=2, **kwargs))
    untouched = all(p.grad is None for p in head.parameters())
    return kind, message if untouched else "work was done: " + message


def head_refusals(rank: int, world: int) -> Dict[str, Tuple[str, str]]:
    """The vocabulary-parallel tiled loss on ``lm_head`` layouts it cannot read its rows from: a bias set to a
    Replicate DTensor after ``ColwiseParallel`` laid the head out, a weight whose Shard(0) split is not
    ``torch.chunk``'s (``DTensor.from_local`` with uneven rows), a ``sequence_group`` beside it, and a head FSDP2 shards
    again over a second mesh dimension."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    head = _colwise_head(mesh, bias=True)
    whole_bias = head.bias.full_tensor().detach()
    head.bias = nn.Parameter(DTensor.from_local(whole_bias, mesh, [Replicate()], run_check=False))
    out["replicated_bias"] = _loss_outcome(head)
    head = _colwise_head(mesh)
    whole = head.weight.full_tensor().detach()
    cut = VOCAB // world + 4  # rank 0 holds 4 rows more than torch.chunk gives it, the last rank fewer
    rows = whole[:cut] if rank == 0 else whole[cut:]
    head.weight = nn.Parameter(DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=whole.shape,
                                                  stride=whole.stride()))
    out["uneven_rows"] = _loss_outcome(head)
    out["sequence_group"] = _loss_outcome(_colwise_head(mesh), sequence_group=dist.new_group())
    # FSDP2 over the TP head, resharded after its forward: the weight is a DTensor on the 2-D mesh.
    from torch.distributed.fsdp import fully_shard

    two_d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    head = _colwise_head(two_d["tp"])
    fully_shard(head, mesh=two_d["dp"])
    head.reshard()
    out["resharded_by_fsdp2"] = _loss_outcome(head)
    return out


def hf_head_refusals(rank: int, world: int, path: str) -> Dict[str, Tuple[str, str]]:
    """The tiled loss alone (``apply_tiled_loss``, no tiled MLP) on a model Hugging Face laid out (``tp_plan``):
    under a transformers version the seam was not checked on, and with ``lm_head`` under a subclass of HF's
    ColwiseParallel (which the seam does not prove): the error of the first labelled forward."""
    from transformers.distributed import tensor_parallel

    from tiled_mlp.integrations import apply_tiled_loss
    from tiled_mlp.strategies import hf_tensor_parallel

    from .hf_tp_cases import BATCH, SEQUENCE, _load

    class SubclassedColwise(tensor_parallel.ColwiseParallel):
        pass

    ids = torch.zeros(BATCH, SEQUENCE, dtype=torch.long)
    out = {}
    model = _load(path, tensor_parallel=True)
    with mock.patch.object(hf_tensor_parallel, "CHECKED_VERSIONS", ("0.0.0",)):
        apply_tiled_loss(model)
        out["unchecked_version"] = raised(lambda: model(input_ids=ids, labels=ids))
    model = _load(path, tensor_parallel=True)
    forward = vars(model.lm_head)["forward"]  # HF's tp_forward, a closure over its style (``self``)
    cell = forward.__closure__[forward.__code__.co_freevars.index("self")]
    style = SubclassedColwise()
    vars(style).update(vars(cell.cell_contents))
    cell.cell_contents = style
    apply_tiled_loss(model)
    out["unproven_style"] = raised(lambda: model(input_ids=ids, labels=ids))
    return out


class LinearSubclass(nn.Linear):
    """A Linear of another class: Hugging Face's style on it is not the seam's proof (a plain ``nn.Linear``)."""


def _unprove(model: nn.Module, how: str) -> Any:
    """Undo one condition of the seam's proof on layer 0's gate_proj (``hf_tensor_parallel.proven_style``); returns
    a context manager to run the model in."""
    import contextlib
    import copy
    import functools

    from transformers.distributed import tensor_parallel

    linear = model.model.layers[0].mlp.gate_proj
    forward = vars(linear)["forward"]  # HF's tp_forward, a closure over its style and the Linear's own forward
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__, strict=True))
    if how == "style_attribute":  # on a copy: HF's style instances are shared by every model of the process
        style = copy.copy(cells["self"].cell_contents)
        style.note = "set on the instance"
        cells["self"].cell_contents = style
    elif how == "linear_class":
        linear.__class__ = LinearSubclass
    elif how == "inner_forward":
        cells["original_forward"].cell_contents = functools.partial(nn.Linear.forward, linear)
    elif how == "class_method":
        original = tensor_parallel.ColwiseParallel.transform_inputs_pre_forward

        def passing_through(self, *args, **kwargs):
            return original(self, *args, **kwargs)

        return mock.patch.object(tensor_parallel.ColwiseParallel, "transform_inputs_pre_forward", passing_through)
    return contextlib.nullcontext()


UNPROVEN = ("style_attribute", "class_method", "linear_class", "inner_forward")


def hf_unproven_layouts(rank: int, world: int, path: str) -> Dict[str, Tuple[str, Tuple[str, str]]]:
    """Hugging Face's tensor parallelism with one condition of the seam's proof undone on one Linear of an MLP,
    tiled with ``apply_tiled_mlp``: what the report expects of that MLP, and the error of the first forward."""
    from tiled_mlp.integrations import apply_tiled_mlp

    from .hf_tp_cases import BATCH, SEQUENCE, _load

    ids = torch.zeros(BATCH, SEQUENCE, dtype=torch.long)
    out = {}
    for how in UNPROVEN:
        model = _load(path, tensor_parallel=True)
        with _unprove(model, how):
            report = apply_tiled_mlp(model, num_shards=2)
            out[how] = (report.patched[0].expected_path, raised(lambda m=model: m(input_ids=ids)))
    return out


class TPFusedMLP(nn.Module):
    """Phi-3's fused MLP (one ``gate_up_proj``, chunked into gate and up), declared to the fast kernel."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(tp_cases.HIDDEN, 2 * tp_cases.INTERMEDIATE, bias=False, dtype=torch.float64)
        self.down_proj = nn.Linear(tp_cases.INTERMEDIATE, tp_cases.HIDDEN, bias=False, dtype=torch.float64)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _fast_outcome(mlp: nn.Module) -> str:
    """The error of a call of ``mlp`` tiled with ``path="fast"``, or what it returned."""
    from tiled_mlp import TiledMLP

    from .tp_cases import step_data

    try:
        TiledMLP(mlp, num_shards=2, path="fast")
        y = mlp(step_data(0)[0].requires_grad_(True))
    except (RuntimeError, ValueError) as error:
        return f"raised: {error}"
    return f"returned {tuple(y.shape)} through {mlp.tiling.last_path}"


def fast_view_declines(rank: int, world: int) -> Dict[str, str]:
    """The gated MLP laid out in ways the fast kernel's local view does not prove, each tiled with ``path="fast"``:
    the reason it declines, which the forced path raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tiled_mlp import register_gated_mlp

    from .tp_cases import gated_mlp

    mesh = init_device_mesh("cpu", (world,))
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("other",))

    def laid_out(plan, module=None, on=mesh):
        return parallelize_module(module if module is not None else gated_mlp(), on, plan)

    col, row = ColwiseParallel, RowwiseParallel
    out = {}
    register_gated_mlp(TPFusedMLP, gate=None, up=None, gate_up="gate_up_proj", activation="act_fn")
    torch.manual_seed(0)
    out["fused"] = _fast_outcome(laid_out({"gate_up_proj": col(), "down_proj": row()}, TPFusedMLP()))
    out["down_plain"] = _fast_outcome(laid_out({"gate_proj": col(), "up_proj": col()}))
    mlp = laid_out({"gate_proj": col(), "up_proj": col()})
    out["two_meshes"] = _fast_outcome(parallelize_module(mlp, other, {"down_proj": row()}))
    mlp = laid_out({"gate_proj": col(), "up_proj": col(), "down_proj": row()})
    whole = mlp.gate_proj.weight.full_tensor().detach()
    mlp.gate_proj.weight = nn.Parameter(DTensor.from_local(whole, mesh, [Replicate()], run_check=False))
    out["replicated_weight"] = _fast_outcome(mlp)
    mlp = laid_out({"gate_proj": row(), "up_proj": col(), "down_proj": row()})
    whole = mlp.gate_proj.weight.full_tensor().detach()  # laid out by rows as ColwiseParallel would, its hooks kept
    rows = whole.chunk(world)[rank]
    mlp.gate_proj.weight = nn.Parameter(DTensor.from_local(rows, mesh, [Shard(0)], run_check=False))
    out["rowwise_gate"] = _fast_outcome(mlp)
    out["inputs_differ"] = _fast_outcome(laid_out({"gate_proj": col(), "up_proj": col(input_layouts=Shard(1)),
                                                   "down_proj": row()}))
    sharded_product = [col(), col()]
    for style in sharded_product:  # ColwiseParallel fixes it to Replicate; it is a public attribute
        style.desired_input_layouts = (Shard(-1),)
    out["input_not_replicated"] = _fast_outcome(laid_out({"gate_proj": sharded_product[0], "up_proj": sharded_product[1],
                                                          "down_proj": row()}))
    out["down_input"] = _fast_outcome(laid_out({"gate_proj": col(), "up_proj": col(),
                                                "down_proj": row(input_layouts=Replicate())}))
    return out


def sequence_view_declines(rank: int, world: int) -> Dict[str, str]:
    """A norm under ``SequenceParallel`` laid out in ways the sequence-parallel view does not prove: the error of
    its tiled call (the generic kernel is refused with the view's reason)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("other",))
    x = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    norm = _sequence_parallel_norm(mesh)
    norm.add_module("after", nn.Identity())  # a submodule without parameters (with them, SequenceParallel fails)
    out = {"submodule": tiled_norm_outcome(norm, x)}
    norm = _sequence_parallel_norm(mesh)
    norm.register_forward_hook(lambda module, args, output: None)
    out["extra_hook"] = tiled_norm_outcome(norm, x)
    norm = _sequence_parallel_norm(mesh)
    norm.weight.requires_grad_(False)
    out["frozen"] = tiled_norm_outcome(norm, x)
    norm = _sequence_parallel_norm(mesh)
    norm.register_parameter("shift", nn.Parameter(torch.zeros(HIDDEN, dtype=torch.float64)))
    out["plain_parameter"] = tiled_norm_outcome(norm, x)
    norm = _sequence_parallel_norm(mesh)
    weight = norm.weight.to_local().detach()
    norm.weight = nn.Parameter(DTensor.from_local(weight[: HIDDEN // world], mesh, [Shard(0)], run_check=False))
    out["sharded_weight"] = tiled_norm_outcome(norm, x)
    norm = _sequence_parallel_norm(mesh)
    norm.weight = nn.Parameter(DTensor.from_local(weight, other, [Replicate()], run_check=False))
    out["weight_on_other_mesh"] = tiled_norm_outcome(norm, x)
    style = SequenceParallel(use_local_output=True)
    style.sequence_sharding = (Replicate(),)  # SequenceParallel fixes it to one Shard; a public attribute
    norm = parallelize_module(nn.RMSNorm(HIDDEN, dtype=torch.float64), mesh, style)
    out["replicated_input"] = tiled_norm_outcome(norm, x)
    return out
