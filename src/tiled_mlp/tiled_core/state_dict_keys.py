"""Keep a wrapper invisible in ``state_dict``: its child's keys appear without the child's name.

A wrapper that holds the original module as ``self.<child>`` would otherwise add ``<child>.`` to every
key, and checkpoints saved from the untiled model would no longer load (nor the other way round).
"""
from __future__ import annotations

import functools

from torch import nn


def _drop_child_prefix(child: str, module, state_dict, prefix, local_metadata):
    inner = prefix + child + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    return state_dict


def _add_child_prefix(child: str, module, state_dict, prefix, local_metadata, strict, missing_keys,
                      unexpected_keys, error_msgs):
    # Every key under this wrapper belongs to the child: the wrapper has no tensors of its own. All of
    # them get the child's name, also those that already start with it (a child of the child that has
    # the same name, e.g. an MLP holding ``mlp``).
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + child + "." + key[len(prefix):]] = state_dict.pop(key)


def hide_child_in_state_dict(wrapper: nn.Module, child: str) -> None:
    wrapper._register_state_dict_hook(functools.partial(_drop_child_prefix, child))
    wrapper._register_load_state_dict_pre_hook(functools.partial(_add_child_prefix, child), with_module=True)
