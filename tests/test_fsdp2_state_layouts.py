"""FSDP2's private state as each torch release lays it out: a list of parameter groups from torch 2.12 on
(``_fsdp_param_groups``), one group before (``_fsdp_param_group``). Both are read when the FSDP2 strategy
claims a module; a layout with neither is refused with the torch version named, never read as "no FSDP2"
(on torch 2.11 that made a module inside an FSDP2 unit resolve to the single-device strategy, and
sequence parallelism's FSDP2 checks did not run). The real states are exercised by the gloo tests
(``integration_tests/test_fsdp2.py``); these stand-ins pin each layout on whichever torch runs them.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from tiled_mlp.strategies import fsdp2

pytestmark = pytest.mark.timeout(60)


def _group(module: nn.Module):
    info = SimpleNamespace(module=module, shared_modules=[])
    mesh_info = SimpleNamespace()
    return SimpleNamespace(fsdp_params=[SimpleNamespace(_module_info=info)], mesh_info=mesh_info)


@pytest.mark.parametrize("layout", ["groups", "group"])
def test_both_layouts_find_the_unit_managing_a_parameter(monkeypatch, layout):
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    group = _group(mlp[0])
    state = SimpleNamespace(_fsdp_param_groups=[group]) if layout == "groups" else SimpleNamespace(_fsdp_param_group=group)
    monkeypatch.setattr(fsdp2, "_fsdp2_states", lambda: iter([state]))
    assert fsdp2.params_managed_by_fsdp2(mlp)
    assert not fsdp2.params_managed_by_fsdp2(nn.Linear(4, 4))  # another module's parameters


def test_a_state_with_no_group_manages_nothing(monkeypatch):
    monkeypatch.setattr(fsdp2, "_fsdp2_states", lambda: iter([SimpleNamespace(_fsdp_param_group=None)]))
    assert not fsdp2.params_managed_by_fsdp2(nn.Linear(4, 4))


def test_an_unknown_layout_is_refused_not_read_as_no_fsdp2(monkeypatch):
    monkeypatch.setattr(fsdp2, "_fsdp2_states", lambda: iter([SimpleNamespace()]))
    with pytest.raises(RuntimeError, match="cannot read FSDP2's parameter groups"):
        fsdp2.params_managed_by_fsdp2(nn.Linear(4, 4))
