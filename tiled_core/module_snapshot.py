"""What a module tree is made of, taken once and compared at every call by identity.

A cached call plan (``call_plan.py``) rests on everything in the module tree: every attribute of every
submodule (``training``, a ``self.scale = 2.0`` the forward reads, ``GELU.approximate``, a tensor
attribute, an instance ``forward``), the parameter, buffer and child registries, the hook dicts,
each submodule's class and its class's forward, each parameter's and buffer's dtype, device and
``requires_grad`` (a tensor keeps its identity through ``module.to(dtype)`` and ``requires_grad_()``),
and the hooks registered for every module (``register_module_forward_hook``).

``ModuleSnapshot`` walks the tree once and keeps all of that as flat columns: the dicts themselves,
their sizes, their keys and their values, the objects held (so no compared object can be freed while
the snapshot lives). ``holds`` compares the columns with what the dicts hold now, a few C-level passes
(``map``/``itertools.chain`` over the dicts, ``operator.is_``): the tree is the same as long as the
module asked about is the root it was taken from (a state moved to another module, which would bring
its snapshot along), every module's ``__dict__`` is the dict it was (not one assigned in its place), and the
root's dicts hold the same objects, and so, child by child, does every dict below. Values are compared
by identity: anything rebound, even to an equal value, counts as a change (a needless re-decision, never
a missed one). Keys (attribute names, hook ids) are compared by equality, the dicts' own notion of the
same key, in one tuple comparison. A value changed in place inside a mutable attribute (a list the forward reads) is not seen; such
a module is not one the fast path accepts (``gated_spec``).
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, List, Tuple

import torch
from torch import nn

from .gated_spec import MODULE_HOOK_DICTS, global_module_hooks

# The dicts of one module the snapshot compares, besides its ``__dict__`` (which holds each of them).
_REGISTRIES = ("_parameters", "_buffers", "_modules")

_forward_of = operator.attrgetter("forward")
_dict_of = operator.attrgetter("__dict__")


# A tensor's (dtype, device, requires_grad), read in C: no Python frame per tensor.
_tensor_state: Callable[[torch.Tensor], Tuple[Any, Any, bool]] = operator.attrgetter("dtype", "device", "requires_grad")




class ModuleSnapshot:
    """The module tree below (and including) one module, as it is now (see the module doc)."""

    __slots__ = ("_modules", "_module_dicts", "_classes", "_forwards", "_dicts", "_sizes", "_filled", "_filled_values",
                 "_keys", "_values", "_tensors", "_tensor_states", "_global_hooks")

    def __init__(self, module: nn.Module):
        modules: List[nn.Module] = []
        dicts: List[dict] = []
        tensors: List[torch.Tensor] = []
        stack = [module]
        while stack:
            sub = stack.pop()
            d = sub.__dict__
            modules.append(sub)
            dicts.append(d)
            dicts.extend(d[name] for name in _REGISTRIES)
            dicts.extend(d[name] for name in MODULE_HOOK_DICTS)
            tensors.extend(t for t in itertools.chain(d["_parameters"].values(), d["_buffers"].values()) if t is not None)
            # Every child, duplicates and all (one module reached twice is still one more call).
            stack.extend(child for child in d["_modules"].values() if child is not None)
        self._modules = tuple(modules)
        self._module_dicts = tuple(map(_dict_of, modules))
        self._classes = tuple(map(type, modules))
        # The class's forward by identity: a forward patched on the class.
        self._forwards = tuple(map(_forward_of, self._classes))
        self._dicts = tuple(dicts)
        self._sizes = list(map(len, dicts))
        # Keys and values are compared only in the dicts that held something (most hook dicts and many
        # registries are empty): one that was empty and has the same size now is still empty.
        self._filled = tuple(d for d in dicts if d)
        self._filled_values = tuple(d.values() for d in self._filled)  # live views of each dict's values
        self._keys = tuple(itertools.chain.from_iterable(self._filled))
        self._values = tuple(itertools.chain.from_iterable(self._filled_values))
        self._tensors = tuple(tensors)
        self._tensor_states = list(map(_tensor_state, tensors))
        # The hooks registered for every module, by handle id (never reused).
        self._global_hooks = list(map(tuple, global_module_hooks()))

    def holds(self, root: nn.Module) -> bool:
        """Whether the tree below ``root`` is still what it was when the snapshot was taken: the same root
        (a tiling state handed to another module, ``twin.__dict__["tiling"] = tiled.tiling``, brings this
        snapshot with it; ``copy.copy`` gives the copy a state of its own),
        each module's ``__dict__`` the same dict (one replaced wholesale holds other attributes)."""
        return (self._modules[0] is root
                and all(map(operator.is_, map(_dict_of, self._modules), self._module_dicts))
                and all(map(operator.is_, map(type, self._modules), self._classes))
                and all(map(operator.is_, map(_forward_of, self._classes), self._forwards))
                # Same sizes first: the flat columns below then line up entry for entry.
                and list(map(len, self._dicts)) == self._sizes
                # Keys by equality, as the dicts themselves find them (names and hook ids): one tuple
                # comparison in C, with no call per key.
                and tuple(itertools.chain.from_iterable(self._filled)) == self._keys
                and all(map(operator.is_, itertools.chain.from_iterable(self._filled_values), self._values))
                and list(map(_tensor_state, self._tensors)) == self._tensor_states
                and list(map(tuple, global_module_hooks())) == self._global_hooks)
