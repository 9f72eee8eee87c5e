"""The outputs of a meta-device op, remembered by what they depend on, so that a full-depth step is not
a hundred thousand Python shape computations.

Most meta kernels are written in Python (``torch._refs``, ``torch._decomp``, ``_meta_registrations``)
and cost 100 to 1000 us an op; a tiled 8B step at 131072 tokens is some 100,000 ops, nearly all
repeats (32 layers, each of tens of MLP and loss shards of one shape). On the meta device an op's
outputs depend only on the op, its tensors' shapes, strides and dtypes and its other arguments, never
on values. So the first call of each kind is made and what it returned is kept: each output either
one of the inputs (an in-place op, ``out=``) or a new storage of its own of a given shape, stride and
dtype; later calls get that input back, or an empty tensor of exactly that metadata. A call is made as
it is, every time, when its outputs are anything else (a view, an output sharing a storage, a size
``empty_strided`` would not give), when it changes an input's shape, stride or storage, or when any
argument is not a plain meta-device value. The measured CPU step never takes this path; that the meta
step still equals it to the byte is what ``tests/planner/test_planner.py`` and ``tests/planner/test_planner_loss.py``
check.
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

# Per output leaf: ("in", index among the inputs' leaves), ("new", shape, stride, dtype) or ("value", v).
_Spec = Optional[Tuple[Any, List[tuple]]]
_PLAIN = (torch.Tensor, torch.nn.Parameter)
MAX_KEPT = 200_000  # distinct calls remembered; a plan makes a few thousand
_META = torch.device("meta")


class _NotMeta(Exception):
    """An argument the key cannot describe as a meta-device value: the call is made as it is."""


_SCALARS = frozenset({bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


def _key_of(value: Any) -> Hashable:
    # The common exact types first (a step makes a million of these keys); anything else, subclasses
    # included, takes the general rules below, which give the same key for the same value.
    kind = type(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if not value.is_meta or value.layout != torch.strided:
            raise _NotMeta
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if kind in _SCALARS:
        return (kind.__name__, value)
    if kind is list or kind is tuple:
        return (kind.__name__, tuple([_key_of(v) for v in value]))
    if isinstance(value, torch.Tensor):
        # A parameter is a plain tensor to the meta kernels (``nn.Parameter`` adds no dispatch of its own).
        if type(value) not in _PLAIN or value.device.type != "meta" or value.layout != torch.strided:
            raise _NotMeta
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key_of(v) for v in value))
    if isinstance(value, dict):
        return ("D", tuple(sorted((k, _key_of(v)) for k, v in value.items())))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return (type(value).__name__, value)
    raise _NotMeta  # a generator, a symbolic size, anything whose effect on the outputs is not plain


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage()._cdata, t.untyped_storage().nbytes()


class MetaOutputs:
    def __init__(self) -> None:
        self._kept: Dict[Hashable, _Spec] = {}
        # Per kept call whose remade outputs are one tensor and nothing around it (most ops): the tensor
        # itself, without the tree, as ``_single`` describes it.
        self._single: Dict[Hashable, tuple] = {}

    def call(self, func, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)``, or what it returned the first time (see the module doc)."""
        key = self._key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        single = self._single.get(key)
        if single is not None:
            if single[0] == "new":
                return torch.empty_strided(single[1], single[2], dtype=single[3], device=_META)
            return args[single[1]]
        if key not in self._kept:
            inputs = tree_flatten((args, kwargs))[0]
            before = [_layout(t) if isinstance(t, torch.Tensor) else None for t in inputs]
            out = func(*args, **kwargs)
            if len(self._kept) >= MAX_KEPT:
                self._kept.clear()
                self._single.clear()
            spec = self._kept[key] = _spec_of(out, inputs, before, _written(func, args, kwargs, inputs))
            single = _single(spec, args, inputs)
            if single is not None:
                self._single[key] = single
            return out
        spec = self._kept[key]
        if spec is None:
            return func(*args, **kwargs)
        tree, leaves = spec
        inputs = tree_flatten((args, kwargs))[0] if any(leaf[0] == "in" for leaf in leaves) else []
        return tree_unflatten([_remade(leaf, inputs) for leaf in leaves], tree)

    @staticmethod
    def _key(func, args: tuple, kwargs: dict) -> Optional[Hashable]:
        # A view op's output shares its input's storage, which ``_spec_of`` never remembers: it is not keyed
        # at all (three in four ops of a tiled step are a shard loop's slices).
        if not isinstance(func, torch._ops.OpOverload) or func.is_view:
            return None
        try:
            return (func, _args_key(args), _key_of(kwargs) if kwargs else None)
        except _NotMeta:
            return None


def _args_key(args: tuple) -> tuple:
    """``_key_of(args)``'s information, built in one loop: a step makes a million of these keys, nearly
    all of plain meta tensors, whose key is written out here rather than by a call per argument."""
    keys: List[Hashable] = []
    for value in args:
        kind = type(value)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if not value.is_meta or value.layout != torch.strided:
                raise _NotMeta
            keys.append(("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype))
        else:
            keys.append(_key_of(value))
    return tuple(keys)


def _single(spec: _Spec, args: tuple, inputs: list) -> Optional[tuple]:
    """For a kept call that returns one tensor, not in a container: ("new", shape, stride, dtype), or
    ("arg", position) where that tensor is a positional argument (an in-place op's) that appears once
    among the inputs. The key fixes the arguments' structure, so the position holds for every call of
    that key. None otherwise (the general path remakes it)."""
    if spec is None:
        return None
    tree, leaves = spec
    if not tree.is_leaf() or len(leaves) != 1:
        return None
    leaf = leaves[0]
    if leaf[0] == "new":
        return leaf
    if leaf[0] == "in":
        returned = inputs[leaf[1]]
        position = next((i for i, a in enumerate(args) if a is returned), None)
        if position is not None and sum(1 for t in inputs if t is returned) == 1:
            return ("arg", position)
    return None


def _remade(leaf: tuple, inputs: list) -> Any:
    if leaf[0] == "in":
        return inputs[leaf[1]]
    if leaf[0] == "new":
        return torch.empty_strided(leaf[1], leaf[2], dtype=leaf[3], device="meta")
    return leaf[1]


def _written(func, args: tuple, kwargs: dict, inputs: list) -> List[int]:
    """The indexes among ``inputs`` of the tensors ``func``'s schema says it writes (``Tensor(a!)``)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        written += [j for j, t in enumerate(inputs) if t is value]
    return written


def _spec_of(out: Any, inputs: list, before: list, mutated: List[int]) -> _Spec:
    """What the call returned, as leaves to remake; None when remade outputs could differ in any byte
    the tracker counts, or the call changed an input's layout (``resize_``, ``set_``)."""
    if any(b is not None and _layout(t) != b for t, b in zip(inputs, before, strict=True)):
        return None
    storages = {b[3] for b in before if b is not None}
    leaves, tree = tree_flatten(out)
    kept: List[tuple] = []
    seen = set()
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            if not isinstance(leaf, (bool, int, float, type(None))):
                return None
            kept.append(("value", leaf))
            continue
        same = next((i for i, t in enumerate(inputs) if t is leaf), None)
        if same is None and mutated and type(leaf) is torch.Tensor:
            # An in-place op whose meta kernel is a decomposition (``addmm_``: ``addmm`` then ``copy_``)
            # returns another tensor object for the tensor it wrote, with that tensor's layout: it is
            # that input, as eager returns it. Only for the argument the op's schema writes: a view op's
            # alias of the same layout is a new tensor.
            same = next((i for i in mutated if type(inputs[i]) is torch.Tensor and _layout(leaf) == before[i]), None)
        if same is not None:
            kept.append(("in", same))
            continue
        if type(leaf) is not torch.Tensor or leaf.device.type != "meta" or leaf.layout != torch.strided:
            return None
        storage = leaf.untyped_storage()
        fresh = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device="meta")
        if (storage._cdata in storages or storage._cdata in seen or leaf.storage_offset() != 0
                or storage.nbytes() != fresh.untyped_storage().nbytes()):
            return None
        seen.add(storage._cdata)
        kept.append(("new", tuple(leaf.shape), leaf.stride(), leaf.dtype))
    return tree, kept
