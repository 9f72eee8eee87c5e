"""ZeRO-3 on a DeepSpeed release it was not checked on is refused before any work, naming the releases and the
way out; on a checked release the check is one cached call and refuses nothing."""
from importlib import metadata

import pytest
from torch import nn

from tiled_mlp.strategies import checked_versions, deepspeed_zero
from tiled_mlp.strategies.base import UnsupportedBackendError


def _zero3_like() -> nn.Module:
    module = nn.Linear(4, 4)
    for p in module.parameters():  # what ZeRO-3 leaves on a partitioned parameter, as the strategy reads it
        p.ds_id, p.ds_status = 0, "NOT_AVAILABLE"
    return module


@pytest.fixture
def installed(monkeypatch):
    def pretend(version: str) -> None:
        real = metadata.version
        monkeypatch.setattr(metadata, "version", lambda name: version if name == "deepspeed" else real(name))
        deepspeed_zero.zero3_version_problem.cache_clear()
        checked_versions.installed.cache_clear()

    yield pretend
    deepspeed_zero.zero3_version_problem.cache_clear()
    checked_versions.installed.cache_clear()


def test_zero3_before_deepspeed_0_19_8_is_refused_with_the_fix(installed, monkeypatch):
    monkeypatch.delenv("TILED_MLP_UNCHECKED_VERSIONS", raising=False)
    for version in ("0.18.6", "0.19.0"):
        installed(version)
        with pytest.raises(UnsupportedBackendError, match=rf"DeepSpeed >= 0.19.8 .*{version}.*TILED_MLP_UNCHECKED_VERSIONS"):
            deepspeed_zero.DeepSpeedZeroStrategy().check_supported(_zero3_like())


def test_zero12_and_checked_releases_and_the_escape_are_not_refused(installed, monkeypatch):
    monkeypatch.delenv("TILED_MLP_UNCHECKED_VERSIONS", raising=False)
    installed("0.18.6")
    deepspeed_zero.DeepSpeedZeroStrategy().check_supported(nn.Linear(4, 4))  # no ZeRO-3 parameter: ZeRO-1/2
    for version in ("0.19.8", "0.20.1+cpu"):
        installed(version)
        deepspeed_zero.DeepSpeedZeroStrategy().check_supported(_zero3_like())
    monkeypatch.setenv("TILED_MLP_UNCHECKED_VERSIONS", "deepspeed")
    installed("0.18.6")
    deepspeed_zero.DeepSpeedZeroStrategy().check_supported(_zero3_like())
