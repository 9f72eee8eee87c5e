"""Axolotl end to end: ``python -m axolotl.cli.train CONFIG`` with ``plugins: [TiledMLPPlugin]`` against the
same run without it, on the tiny local checkpoint (``axolotl_cases``), 3 steps of full fine-tuning with
AdamW in float32 on CPU.

Runs in Axolotl's own environment (Axolotl 0.21.0 needs Python >= 3.12 and pins transformers 5.20.1): see
docs/frameworks.md. The plugin's hooks are also tested without Axolotl, on a stand-in for its
``BasePlugin`` (tests/test_framework_entry_points.py).
"""
from __future__ import annotations

import re

import pytest
import torch

from integration_tests.frameworks import need

SHARDS = dict(tiled_mlp_lib_num_shards=3, tiled_mlp_lib_loss_num_shards=3)  # more than one shard per call


@pytest.fixture(scope="module")
def axolotl():
    return need("axolotl")


def _printed_losses(stdout: str):
    """The losses Axolotl prints, one dict a logging step (``{'loss': '4.171', ...}``): 4 digits."""
    return [float(value) for value in re.findall(r"'loss': '?([0-9.]+)'?", stdout)]


def _runs(tmp_path, float64):
    """The untiled and the tiled run, side by side."""
    from integration_tests.axolotl_cases import finish, start, write_config

    configs = write_config(tmp_path, "untiled", tiled=False), write_config(tmp_path, "tiled", tiled=True, **SHARDS)
    untiled, tiled = [finish(config, process) for config, process in [(c, start(c, float64)) for c in configs]]
    assert untiled["tiled"] == [] and untiled["tiled_loss"] == "NoneType"
    assert len(tiled["tiled"]) == 7, tiled["tiled"]  # 2 MLPs, 5 RMSNorms
    assert tiled["tiled_loss"] == "TiledLossForward"
    assert len(tiled["losses"]) == len(untiled["losses"]) == 3
    assert tiled["weights"].keys() == untiled["weights"].keys()  # tiling in place: the same names
    return untiled, tiled


def _compare_axolotl_runs(untiled, tiled, loss_rtol, weight_atol):
    """Each step's loss, and every weight after the last step (AdamW, lr 1e-2: a step moves a weight ~1e-2)."""
    torch.testing.assert_close(torch.tensor(tiled["losses"], dtype=torch.float64),
                               torch.tensor(untiled["losses"], dtype=torch.float64), rtol=loss_rtol, atol=0)
    for key, weight in untiled["weights"].items():
        torch.testing.assert_close(tiled["weights"][key], weight, rtol=0, atol=weight_atol, msg=key)


def test_float32_as_axolotl_runs_it(axolotl, tmp_path):
    untiled, tiled = _runs(tmp_path, float64=False)
    printed = _printed_losses(tiled["stdout"])
    assert len(printed) == 3 and printed == _printed_losses(untiled["stdout"])  # what Axolotl shows, 4 digits
    _compare_axolotl_runs(untiled, tiled, loss_rtol=1e-6, weight_atol=1e-5)


def test_float64_tiled_equals_untiled(axolotl, tmp_path):
    untiled, tiled = _runs(tmp_path, float64=True)
    assert all(w.dtype == torch.float64 for w in tiled["weights"].values() if w.is_floating_point())
    _compare_axolotl_runs(untiled, tiled, loss_rtol=1e-13, weight_atol=1e-13)


def test_axolotls_own_tiled_mlp_with_the_plugin_is_refused(axolotl, tmp_path):
    from integration_tests.axolotl_cases import run_axolotl, write_config

    with pytest.raises(RuntimeError, match="both tile the MLPs"):
        run_axolotl(write_config(tmp_path, "both", tiled=True, tiled_mlp=True))
