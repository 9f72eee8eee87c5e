"""DTensor tensor parallelism (``parallelize_module``) beside whichever strategy claims the parameters: every
strategy's ``local_view``, ``is_backend_hook`` and ``per_shard_problem`` consult this file. Hooks are recognised
by what they are (``distribute_module``'s lambdas over a proven style's functions, compared as objects). The
layouts, the local views' arithmetic, what is proven and what is refused: docs/backends.md, "Tensor parallelism".
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import hf_tensor_parallel as hf_tp


@functools.lru_cache(maxsize=1)
def _styles() -> Tuple[frozenset, Any, Any, Any, Any]:
    from torch.distributed.tensor import _api
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    lambdas = frozenset(c for c in _api.distribute_module.__code__.co_consts if getattr(c, "co_name", "") == "<lambda>")
    return (lambdas, ColwiseParallel._prepare_input_fn, ColwiseParallel._prepare_output_fn,
            RowwiseParallel._prepare_input_fn, RowwiseParallel._prepare_output_fn)


def _hook_parts(hook: Any) -> Optional[Tuple[functools.partial, Any]]:
    """(the partial a ``distribute_module`` hook runs, its mesh), else None."""
    code = getattr(hook, "__code__", None)
    if code is None or code not in _styles()[0]:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in hook.__closure__ or ()), strict=True))
    fn = cells.get("input_fn", cells.get("output_fn"))
    return (fn, cells.get("device_mesh")) if isinstance(fn, functools.partial) else None


def style_hook(hook: Any, functions: Optional[Sequence[Any]] = None) -> Optional[Tuple[functools.partial, Any]]:
    """The parts of a hook of a proven style (``functions``: ColwiseParallel's and RowwiseParallel's), else None:
    the partial's ``func`` is the style's static method, its ``args`` the layouts bound to it."""
    parts = _hook_parts(hook)
    if parts is None or parts[0].func not in (functions or _styles()[1:]) or parts[0].keywords:
        return None
    return parts


def parallel_style_of(hook: Any) -> Optional[type]:
    """The ParallelStyle class whose function a ``distribute_module`` hook runs, proven or not (to name it)."""
    from torch.distributed.tensor.parallel.style import ParallelStyle

    parts = _hook_parts(hook)
    function = getattr(parts[0].func, "__func__", parts[0].func) if parts is not None else None
    todo: List[type] = [ParallelStyle] if function is not None else []
    while todo:
        cls = todo.pop()
        if any(getattr(attr, "__func__", attr) is function for attr in vars(cls).values()):
            return cls
        todo.extend(cls.__subclasses__())
    return None


def style_hooks_of(module: nn.Module) -> List[Tuple[Any, type]]:
    pre, post = _hooks(module)
    return [(hook, style) for hook in (*pre, *post) if (style := parallel_style_of(hook)) is not None]


def is_tensor_parallel_hook(hook: Any) -> bool:
    return style_hook(hook) is not None or hf_tp.is_hf_tensor_parallel_forward(hook)


# A plain tensor or parameter is no DTensor: asked at every tiled call, answered by type before anything else.
_PLAIN_TYPES = frozenset((torch.Tensor, nn.Parameter))


def has_dtensor(tensors: Sequence[torch.Tensor]) -> bool:
    if _PLAIN_TYPES.issuperset(map(type, tensors)):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in tensors)


def local_numel(t: torch.Tensor) -> int:
    """Elements the largest share of a DTensor's ranks holds (``torch.chunk``'s split), alike on every rank."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.numel()
    shape = list(t.shape)
    for ranks, placement in zip(t.device_mesh.shape, t.placements, strict=True):
        if placement.is_shard():
            dim = placement.dim % len(shape)  # type: ignore[attr-defined]  # a Shard placement
            shape[dim] = -(-shape[dim] // ranks)
    return math.prod(shape)


def _hooks(module: nn.Module) -> Tuple[List[Any], List[Any]]:
    return list(module._forward_pre_hooks.values()), list(module._forward_hooks.values())


@dataclass(frozen=True)
class LinearStyle:
    """A proven column- or row-wise style on one module, read from torch's hooks (``ColwiseParallel``,
    ``RowwiseParallel``) or from Hugging Face's forward (``hf_tensor_parallel.py``): one record for both."""

    kind: str  # "colwise" or "rowwise"
    name: str  # how a message names the style
    mesh: Any
    input_layouts: tuple  # how a plain input is read
    made: tuple  # what the input is made before the product
    output_layouts: tuple  # what the output is redistributed to
    use_local_output: bool
    module: nn.Module
    hooks: tuple = ()  # torch's input and output hook, run as they are; () for Hugging Face's, computed as it does

    def prepare_input(self, x: torch.Tensor) -> Any:
        """The module's input as the DTensor the product takes."""
        from torch.distributed.tensor import DTensor

        if self.hooks:
            made = self.hooks[0](self.module, (x,))
            return made[0] if isinstance(made, tuple) else made
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, self.input_layouts, run_check=False)
        return x if tuple(x.placements) == self.made else x.redistribute(placements=list(self.made))

    def finish_output(self, out: Any) -> Any:
        """What the module hands on, from the product (a DTensor)."""
        if self.hooks:
            result = self.hooks[1](self.module, (), out)
            return out if result is None else result
        if tuple(out.placements) != self.output_layouts:
            out = out.redistribute(placements=list(self.output_layouts))
        return out.to_local() if self.use_local_output else out


def _placements(layout: Any) -> tuple:
    return tuple(layout) if isinstance(layout, (tuple, list)) else (layout,)


def linear_style(module: nn.Module) -> Optional[LinearStyle]:
    """The proven style laying ``module`` out: one input and one output hook of ColwiseParallel or RowwiseParallel
    among its hooks, or Hugging Face's own style as its forward; else None."""
    from torch.distributed.tensor import Replicate

    hf = hf_tp.proven_style(module)
    if hf is not None:
        kind, style, mesh = hf
        read = _placements(style.input_layouts)
        return LinearStyle(kind, f"Hugging Face's {kind}", mesh, read,
                           (Replicate(),) if kind == "colwise" else read, _placements(style.output_layouts),
                           bool(style.use_local_output), module)
    _, col_in, col_out, row_in, row_out = _styles()
    pre, post = ([(hook, found) for hook in hooks if (found := style_hook(hook))] for hooks in _hooks(module))
    if len(pre) != 1 or len(post) != 1:
        return None
    (pre_hook, (take, mesh)), (post_hook, (give, out_mesh)) = pre[0], post[0]
    torch_kind = {(col_in, col_out): "colwise", (row_in, row_out): "rowwise"}.get((take.func, give.func))
    if torch_kind is None or mesh != out_mesh:
        return None
    (read, made), (output_layouts, use_local) = take.args, give.args
    return LinearStyle(torch_kind, take.func.__qualname__.split(".")[0], mesh, _placements(read), _placements(made),
                       _placements(output_layouts), bool(use_local), module, (pre_hook, post_hook))


@dataclass
class TensorParallelView:
    """The local view of one gated MLP call; where ``why_not`` is set, the fast kernel declines with it."""

    why_not: str = ""
    gate: Optional[LinearStyle] = None
    down: Optional[LinearStyle] = None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Partial

        assert self.gate is not None, "a declined view is never entered"
        return self.gate.prepare_input(x).to_local(grad_placements=[Partial()])

    def params(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return [t.to_local() for t in tensors]  # type: ignore[attr-defined]  # DTensors (tensor_parallel_view)

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial

        assert self.down is not None, "a declined view is never left"
        return self.down.finish_output(DTensor.from_local(out, self.down.mesh, [Partial()], run_check=False))


def _declined(why: str) -> TensorParallelView:
    return TensorParallelView(why_not=f"tensor parallelism: {why}")


def tensor_parallel_view(module: nn.Module, params: Sequence[torch.Tensor]) -> Optional[Any]:
    """None where no parameter is a DTensor; else the view of a ``SequenceParallel`` module or of a gated MLP
    (``gate_proj``, ``up_proj``, ``down_proj``), or a declined one that says why."""
    if not has_dtensor(params):
        return None
    if is_sequence_parallel_module(module):
        return sequence_parallel_view(module, params)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    parts = module._modules
    if "gate_up_proj" in parts:
        return _declined("a fused gate_up_proj is not split into gate and up alike by ColwiseParallel")
    linears: Dict[str, Any] = {name: parts.get(name) for name in ("gate_proj", "up_proj", "down_proj")}
    if None in linears.values():
        return _declined("the fast kernel's local view knows the projections gate_proj, up_proj and down_proj only")
    if getattr(linears["down_proj"], "bias", None) is not None:
        return _declined("down_proj has a bias: a rowwise projection adds it to a partial sum (declined)")
    tensors: List[Any] = [p for linear in linears.values() for p in linear.parameters()]
    if not all(isinstance(p, DTensor) for p in tensors):
        return _declined("some projections' parameters are DTensors and others are not")
    mesh = tensors[0].device_mesh
    # Equal meshes (``DeviceMesh.__eq__``: the same ranks and dimension names), not the same object: a mesh
    # built again over the same ranks is the same mesh to every collective.
    if any(p.device_mesh != mesh for p in tensors) or mesh.ndim != 1:
        return _declined("the projections' parameters are not all on one 1-D mesh")
    styles: Dict[str, LinearStyle] = {}
    for name, linear in linears.items():
        kind, dim = ("rowwise", 1) if name == "down_proj" else ("colwise", 0)
        for what in ("weight", "bias"):
            tensor: Any = getattr(linear, what, None)
            if tensor is not None and tuple(tensor.placements) != (Shard(dim),):
                return _declined(f"{name}.{what} is {tuple(tensor.placements)}, not ({Shard(dim)},)")
        style = linear_style(linear)
        if style is None or style.kind != kind:
            found = hf_tp.installed_style(linear)
            what = (f"Hugging Face's {type(found).__name__}" if found is not None else
                    style.name if style is not None else "no proven tensor-parallel style")
            return _declined(f"{name} is laid out by {what}, not the {kind} style the fast kernel computes "
                             "(ColwiseParallel / RowwiseParallel hooks, or Hugging Face's on transformers "
                             + ", ".join(hf_tp.CHECKED_VERSIONS) + ")")
        if len(linear._forward_pre_hooks) + len(linear._forward_hooks) != len(style.hooks):
            return _declined(f"{name} carries module hooks besides its tensor-parallel style's")
        if style.mesh != mesh:
            return _declined(f"{name}'s tensor-parallel style is on another mesh than its parameters")
        styles[name] = style
    gate, up, down = styles.values()
    if (gate.input_layouts, gate.made) != (up.input_layouts, up.made):
        return _declined(f"gate_proj and up_proj prepare their input differently ({gate.input_layouts, gate.made} vs "
                         f"{up.input_layouts, up.made})")
    if gate.made != (Replicate(),):
        return _declined(f"gate_proj's input is made {gate.made}, not Replicate")
    # The call is decided and its shards planned on the tokens the module is handed; a style that reads a plain
    # input as sharded (input_layouts=Shard(1)) gathers more tokens than were planned, and the shards would
    # cover only the first of them.
    if gate.input_layouts != (Replicate(),):
        return _declined(f"gate_proj's {'input hook' if gate.hooks else 'forward'} reads a plain input as {gate.input_layouts} and gathers it: the "
                         "call is planned on this rank's tokens, not the gathered ones. Put PrepareModuleInput("
                         "input_layouts=Shard(1), desired_input_layouts=Replicate()) on the MLP instead")
    for name, style in (("gate_proj", gate), ("up_proj", up)):
        if style.output_layouts != (Shard(-1),) or not style.use_local_output:
            return _declined(f"{name}'s output is {style.output_layouts} (use_local_output={style.use_local_output}), "
                             "not the local Shard(-1) the rowwise down_proj takes")
    if (down.input_layouts, down.made) != ((Shard(-1),), (Shard(-1),)):
        return _declined(f"down_proj's input is prepared as {down.input_layouts, down.made}, not Shard(-1) kept as it is")
    return TensorParallelView(gate=gate, down=down)


TOKEN_LAYOUT_DECLINED = (
    "tensor parallelism: {name}'s {kind} hook ({style}) lays the tensor out as {layouts}, over a token dimension: "
    "the generic kernel runs the module once per token shard, so that collective would split or gather each "
    "shard's tokens across the ranks instead of the call's (not what one untiled call computes). The fast "
    "kernel's local view reduces once per call: use a gated MLP it runs (path='auto'), or keep the token "
    "dimensions Replicate inside the tiled module (put the sequence layouts outside it)"
)


DTENSOR_PARAMS_REFUSED = (
    "tensor parallelism: {module}'s parameters are DTensors (parallelize_module, distribute_module) "
    "where no ColwiseParallel or RowwiseParallel hook of a submodule lays them out ({where}), "
    "and the tiled call would take its input and build its output as the module's own hooks hand them over "
    "(a sequence-sharded DTensor: shards of the global sequence, an output of the wrong length, measured), which "
    "the generic kernel is not proven to compute exactly: refused. Leave this module untiled (its activations "
    "are already split across the ranks), or tile it without tensor-parallel layouts"
)


def is_sequence_parallel_module(module: nn.Module) -> bool:
    """Every tensor-parallel hook on ``module`` itself is ``SequenceParallel``'s: a norm, never a head."""
    from torch.distributed.tensor.parallel import SequenceParallel

    found = style_hooks_of(module)
    return bool(found) and all(issubclass(style, SequenceParallel) for _, style in found)


@dataclass
class SequenceParallelView:
    """A token-wise module under ``SequenceParallel`` (a norm): each rank tiles its own tokens with the local
    weight; the weight's gradient leaves as a ``Partial`` DTensor, as untiled. The generic kernel runs on it."""

    why_not: str = ""
    mesh: Any = None
    sequence_dim: int = 1
    runs_module_forward: bool = True
    global_shape: Tuple[int, ...] = ()  # the call's input's (``enter``): a view serves one call

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        # First: DTensor writes a negative dimension as its positive one (Shard(-1) is Shard(2)).
        if self.sequence_dim % x.dim() == x.dim() - 1:
            raise RuntimeError("tensor parallelism: SequenceParallel shards the hidden dimension of the input "
                               f"(sequence_dim={self.sequence_dim}): a norm over a slice of the hidden features is "
                               "not the norm; shard a token dimension")
        placements = (Shard(self.sequence_dim % x.dim()),)  # as DTensor writes it
        if not isinstance(x, DTensor) or tuple(x.placements) != placements or x.device_mesh != self.mesh:
            raise RuntimeError(f"tensor parallelism: the tiled call's input is {layout_of(x)}, not the DTensor "
                               f"{placements} on the weight's mesh that SequenceParallel's input hook makes")
        # A token-wise map: the output's global shape is the input's, not one re-derived from this rank's slice.
        self.global_shape = tuple(x.shape)
        return x.to_local()

    def params(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        from torch.distributed.tensor import Partial

        return [t.to_local(grad_placements=[Partial()]) for t in tensors]  # type: ignore[attr-defined]  # DTensors

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        shape = torch.Size((*self.global_shape[:-1], out.shape[-1]))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(out, self.mesh, [Shard(self.sequence_dim)], run_check=False, shape=shape,
                                  stride=stride)


def layout_of(x: Any) -> str:
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return "a plain tensor"
    mesh = x.device_mesh
    return f"a DTensor {tuple(x.placements)} over a {mesh.ndim}-D mesh {tuple(mesh.shape)}"


def _declined_sequence(why: str) -> SequenceParallelView:
    return SequenceParallelView(why_not=f"tensor parallelism (SequenceParallel): {why}")


def sequence_parallel_view(module: nn.Module, params: Sequence[torch.Tensor]) -> SequenceParallelView:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    if any(name for name, _ in module.named_modules()):
        return _declined_sequence(f"{type(module).__name__} has submodules; the view proves a module with none (a norm)")
    pre, post = _hooks(module)
    functions = (SequenceParallel._prepare_input_fn, SequenceParallel._prepare_output_fn)
    found: List[Any] = [style_hook(hook, functions) for hook in (*pre, *post)]
    if len(pre) != 1 or len(post) != 1 or None in found:
        return _declined_sequence(f"{type(module).__name__} has {len(pre)} forward pre-hooks and {len(post)} forward "
                                  "hooks, not SequenceParallel's own input and output hook alone")
    (sequence_in, mesh_in), (_, mesh_out) = found
    owned: List[Any] = list(module.parameters())  # DTensors where the view applies (checked below)
    taken = {id(t) for t in params}
    if any(id(p) not in taken for p in owned):
        return _declined_sequence(f"{type(module).__name__} has a frozen parameter: the view computes with the local "
                                  "tensors of the parameters the call trains only; train it, or leave the module untiled")
    if not all(isinstance(p, DTensor) for p in owned):
        return _declined_sequence("some parameters are DTensors and others are not")
    mesh = owned[0].device_mesh
    if any(p.device_mesh != mesh for p in owned) or mesh.ndim != 1:
        return _declined_sequence(f"the parameters are not all on one 1-D mesh ({layout_of(owned[0])}): a weight "
                                  "on a 2-D mesh is FSDP2's shard of it outside its unit's forward; leave the norm "
                                  "untiled, or keep it out of fully_shard")
    if any(tuple(p.placements) != (Replicate(),) for p in owned):
        return _declined_sequence(f"a parameter is {layout_of(next(p for p in owned if tuple(p.placements) != (Replicate(),)))}, "
                                  "not Replicate")
    if mesh_in != mesh or mesh_out != mesh:
        return _declined_sequence("its hooks are on another mesh than its parameters")
    (sequence_sharding,) = sequence_in.args
    if len(sequence_sharding) != 1 or not isinstance(sequence_sharding[0], Shard):
        return _declined_sequence(f"its input is laid out as {sequence_sharding}, not one Shard")
    return SequenceParallelView(mesh=mesh, sequence_dim=sequence_sharding[0].dim)


def per_shard_problem(module: nn.Module, token_dims: int) -> str:
    """Why the generic kernel (the module's forward once per token shard) is refused under tensor parallelism ("" where
    it computes what one call does): a style that shards a token dimension, or DTensor parameters no proven style
    lays out. Styles that keep the tokens whole run their collectives per shard, as one call does."""
    from torch.distributed.tensor import Shard

    unlaid = []
    for name, sub in module.named_modules():
        style = linear_style(sub) if name else None
        if style is not None:
            for kind, placements in (("input", (*style.input_layouts, *style.made)), ("output", style.output_layouts)):
                if any(isinstance(p, Shard) and p.dim % (token_dims + 1) < token_dims for p in placements):
                    return TOKEN_LAYOUT_DECLINED.format(name=name, kind=kind, style=style.name, layouts=placements)
        elif name and has_dtensor([p for p in sub._parameters.values() if p is not None]):
            other = hf_tp.installed_style(sub)
            unlaid.append(name if other is None else f"{name} (Hugging Face's {type(other).__name__})")
    own = [p for p in module._parameters.values() if p is not None]
    if not unlaid and has_dtensor(own) and is_sequence_parallel_module(module):
        # The generic kernel runs it on the sequence-parallel view (its own refusal where declined).
        return sequence_parallel_view(module, [p for p in module.parameters() if p.requires_grad]).why_not
    if unlaid or has_dtensor(own):
        where = ", ".join(unlaid + (["the module itself"] if has_dtensor(own) else []))
        return DTENSOR_PARAMS_REFUSED.format(module=type(module).__name__, where=where)
    return ""
