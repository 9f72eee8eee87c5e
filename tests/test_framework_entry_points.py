"""The training frameworks' entry points without the frameworks: the version seam, the settings, and the
Axolotl plugin driven through the hooks Axolotl 0.21.0 calls, on a stand-in for its ``BasePlugin``
(``StubBasePlugin`` below: Axolotl 0.21.0 needs Python >= 3.12; the real run is
integration_tests/test_framework_axolotl.py, in Axolotl's own environment).
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
import types

import pytest
import torch

from integration_tests.float64_loss import float64_causal_lm_loss
from integration_tests.tiny_models import grads_by_key, tiny_model
from tiled_mlp.integrations.args import read_settings
from tiled_mlp.integrations.framework_settings import CheckedFramework, FrameworkTiling, FrameworkVersionError

RELEASE = torch.__version__.split("+")[0]  # a local build (+cpu) counts as its release


def test_settings_parse_and_name_the_key():
    assert read_settings(FrameworkTiling, {}) == FrameworkTiling("auto", True, "auto", True)
    given = {"num_shards": " 4 ", "loss": "false", "loss_num_shards": None, "norms": "no"}
    assert read_settings(FrameworkTiling, given) == FrameworkTiling(4, False, "auto", False)
    with pytest.raises(ValueError, match="tiled_mlp_lib_num_shards: num_shards must be"):
        read_settings(FrameworkTiling, {"tiled_mlp_lib_num_shards": 0}, prefix="tiled_mlp_lib_")
    with pytest.raises(ValueError, match="tiled_mlp_lib_norms must be a bool"):
        read_settings(FrameworkTiling, {"tiled_mlp_lib_norms": "maybe"}, prefix="tiled_mlp_lib_")


def test_seam_refuses_other_releases_and_a_missing_framework():
    here = CheckedFramework("Torch", "torch", (RELEASE, "0.0.1"))
    here.require()
    other = dataclasses.replace(here, checked=("0.0.1",))
    with pytest.raises(FrameworkVersionError, match=r"checked on torch 0\.0\.1, not .*pip install torch==0\.0\.1"):
        other.require()
    missing = CheckedFramework("Nothing", "no-such-framework-here", ("1.0",))
    with pytest.raises(FrameworkVersionError, match="it is not installed: pip install no-such-framework-here==1.0"):
        missing.require()


def test_llamafactory_callback_refuses_bad_settings_at_construction():
    from tiled_mlp.integrations.llamafactory import TiledMLPCallback

    with pytest.raises(ValueError, match="num_shards must be 'auto' or an integer"):
        TiledMLPCallback(num_shards=2.5)


class StubBasePlugin:
    """A stand-in for ``axolotl.integrations.base.BasePlugin`` 0.21.0 (the hooks this plugin overrides and
    the ``PluginManager`` calls on every plugin, each a no-op), for machines where Axolotl cannot install."""

    def register(self, cfg): ...
    def get_input_args(self): ...
    def pre_model_load(self, cfg): ...
    def post_model_build(self, cfg, model): ...
    def post_model_load(self, cfg, model): ...


@pytest.fixture
def stub_axolotl(monkeypatch):
    """``axolotl.integrations.base`` holding ``StubBasePlugin``; the plugin's seam checks torch's release instead
    of Axolotl's (there is no Axolotl here to check)."""
    names = ("axolotl", "axolotl.integrations", "axolotl.integrations.base")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["axolotl.integrations.base"].BasePlugin = StubBasePlugin
    module = importlib.import_module("tiled_mlp.integrations.axolotl")
    monkeypatch.setattr(module, "_made", {})
    monkeypatch.setattr(module, "AXOLOTL", CheckedFramework("Axolotl", "torch", (RELEASE,)))
    return module


def test_importing_the_axolotl_plugin_needs_no_axolotl(monkeypatch):
    monkeypatch.setitem(sys.modules, "axolotl", None)  # import axolotl raises
    module = importlib.import_module("tiled_mlp.integrations.axolotl")
    monkeypatch.setattr(module, "_made", {})
    with pytest.raises(ImportError, match="axolotl"):
        module.__getattr__("TiledMLPPlugin")


def test_axolotl_plugin_config_keys(stub_axolotl):
    plugin = stub_axolotl.TiledMLPPlugin()
    assert isinstance(plugin, StubBasePlugin)
    module_name, _, name = plugin.get_input_args().rpartition(".")
    args = getattr(importlib.import_module(module_name), name)
    assert all(key.startswith("tiled_mlp_lib_") for key in args.model_fields)
    assert not {"tiled_mlp", "tiled_mlp_num_shards", "tiled_mlp_use_original_mlp"} & set(args.model_fields)
    parsed = args(tiled_mlp_lib_num_shards="4", tiled_mlp_lib_norms="off")
    assert parsed.tiled_mlp_lib_num_shards == 4 and parsed.tiled_mlp_lib_norms is False
    with pytest.raises(ValueError, match="num_shards must be"):
        args(tiled_mlp_lib_num_shards=0)
    with pytest.raises(ValueError, match="both tile the MLPs"):
        args(tiled_mlp=True)


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), grads_by_key(model)


def test_axolotl_plugin_hooks_tile_mlps_norms_and_loss_exactly(stub_axolotl):
    cfg = {"tiled_mlp_lib_num_shards": 3, "tiled_mlp_lib_loss_num_shards": 3}  # Axolotl's DictDefault: .get
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    untiled = tiny_model("llama")
    untiled.loss_function = float64_causal_lm_loss  # transformers' own loss would round to float32
    want_loss, want = _loss_and_grads(untiled, ids)

    plugin = stub_axolotl.TiledMLPPlugin()
    model = tiny_model("llama")
    plugin.pre_model_load(cfg)
    plugin.post_model_load(cfg, model)
    kinds = [block.kind for block in plugin.report.blocks]
    assert kinds.count("norm") == 5 and len(kinds) == 7 and plugin.report.tiled_loss is not None
    loss, grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
    for key, grad in want.items():
        if grad is not None:
            torch.testing.assert_close(grads[key], grad, rtol=1e-10, atol=1e-12, msg=key)


def test_axolotl_plugin_refuses_an_unchecked_release_before_loading(stub_axolotl, monkeypatch):
    monkeypatch.setattr(stub_axolotl, "AXOLOTL", CheckedFramework("Axolotl", "torch", ("0.0.1",)))
    plugin = stub_axolotl.TiledMLPPlugin()
    with pytest.raises(FrameworkVersionError, match="Axolotl entry point was checked on torch 0.0.1"):
        plugin.pre_model_load({})
    model = tiny_model("llama")
    with pytest.raises(FrameworkVersionError):
        plugin.post_model_load({}, model)
    assert plugin.report is None and not any(type(m).__name__.startswith("Tiled") for m in model.modules())
