"""How the package is installed and found: the repository's ``tiled_core/`` and ``strategies/`` are installed
as ``tiled_mlp.core`` and ``tiled_mlp.strategies`` (pyproject's ``package-dir``, no link in the repository);
the wheel, and a wheel built from the sdist, import and run; a checkout runs its own code; the folders
cannot be imported a second time under their repository names.

Builds run offline (``--no-build-isolation``: the setuptools of the running environment) on a copy of the
sources, so that nothing is written beside them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"tiled_mlp": "tiled_mlp", "tiled_core": "tiled_mlp.core", "strategies": "tiled_mlp.strategies"}
ENV = {**os.environ, "PIP_CONSTRAINT": "", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
in_checkout = pytest.mark.skipif(not (ROOT / "tiled_core").is_dir(), reason="runs on the sources (not an unpacked sdist's tests)")

# A tiny gated MLP tiled in 4 shards against the same module untiled, in float64: the installed code runs.
RUNS = """
import sys, torch, tiled_mlp
from torch import nn
for name in ("tiled_mlp", "tiled_mlp.core", "tiled_mlp.strategies"):
    print(sys.modules[name].__file__)
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
        self.down_proj, self.act_fn = nn.Linear(16, 8, bias=False), nn.SiLU()
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
torch.manual_seed(0)
mlp, x = MLP().double(), torch.randn(2, 64, 8, dtype=torch.float64)
def run():
    mlp.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out = mlp(xi)
    out.square().sum().backward()
    return [out, xi.grad] + [p.grad for p in mlp.parameters()]
want = run()
tiled_mlp.tile(mlp, num_shards=4)
have = run()
assert mlp.tiling.last_num_shards == 4, mlp.tiling.last_reason
assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(want, have))
print("ok")
"""


def listed_packages() -> List[str]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def source_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "source"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".tox", ".torch_extensions*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
        ".hypothesis"))
    return copy


def wheel_of(source: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, capture_output=True, env=ENV, timeout=120)
    (wheel,) = out.glob("*.whl")
    return wheel


def installed(wheel: Path, target: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, env=ENV, timeout=120)
    return target


def run_from(cwd: Path, code: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@in_checkout
def test_every_package_folder_is_listed():
    folders = sorted(".".join((package,) + init.parent.relative_to(ROOT / folder).parts)
                     for folder, package in FOLDERS.items() for init in (ROOT / folder).rglob("__init__.py"))
    assert folders == sorted(listed_packages())


@in_checkout
def test_the_repository_holds_no_link():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    staged = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert [line for line in staged.splitlines() if line.startswith("120000")] == []


@in_checkout
def test_a_folder_is_refused_by_its_repository_name():
    """From the repository's root the folders are importable by their own names: each would be a second copy,
    with registries of its own. Refused, before and after ``import tiled_mlp``."""
    code = """
import importlib, sys
for name in ("strategies", "tiled_core", "tiled_core.kernels", "strategies.registry", "tiled_mlp", "strategies"):
    try:
        importlib.import_module(name)
        print(name, "imported")
    except ImportError as error:
        print(name, "refused" if "is installed as tiled_mlp." in str(error) else error)
"""
    result = run_from(ROOT, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:6] == ["strategies refused", "tiled_core refused", "tiled_core.kernels refused",
                                              "strategies.registry refused", "tiled_mlp imported", "strategies refused"]


@in_checkout
@pytest.mark.timeout(120)
def test_a_checkout_runs_its_own_code(tmp_path):
    """From a checkout's root, ``tiled_mlp``, ``tiled_mlp.core`` and ``tiled_mlp.strategies`` all come from that
    checkout, also where the environment holds an editable install of another one (this test's copy is one)."""
    copy = (tmp_path / "checkout").resolve()
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    result = run_from(copy, RUNS)
    assert result.returncode == 0, result.stderr
    files = result.stdout.split()[:3]
    assert files == [str(copy / folder / "__init__.py") for folder in FOLDERS], files
    assert result.stdout.split()[-1] == "ok"


@in_checkout
@pytest.mark.timeout(300)
def test_the_wheel_and_the_sdists_wheel_install_one_name_import_and_run(tmp_path):
    source = source_copy(tmp_path)
    sdist_dir = tmp_path / "sdist"
    build = "import sys; from setuptools.build_meta import build_sdist; print(build_sdist(sys.argv[1]))"
    name = subprocess.run([sys.executable, "-c", build, str(sdist_dir)], cwd=source, check=True, capture_output=True,
                          text=True, env=ENV, timeout=120).stdout.split()[-1]
    with tarfile.open(sdist_dir / name) as archive:
        shipped = {"/".join(n.split("/")[1:]) for n in archive.getnames()}
        archive.extractall(tmp_path / "unpacked", filter="data")
    for needed in ("conftest.py", "tests/test_shard_plan.py", "integration_tests/spawn.py", "tiled_core/tiled_call.py",
                   "strategies/fsdp2.py"):
        assert needed in shipped, needed
    (unpacked,) = (tmp_path / "unpacked").iterdir()

    wheels = {"wheel": wheel_of(source, tmp_path / "w1"), "sdist": wheel_of(unpacked, tmp_path / "w2")}
    contents = {kind: sorted(n for n in zipfile.ZipFile(w).namelist() if ".dist-info/" not in n)
                for kind, w in wheels.items()}
    assert contents["wheel"] == contents["sdist"]
    assert {n.split("/")[0] for n in contents["wheel"]} == {"tiled_mlp"}
    for module in ("tiled_mlp/core/tiled_call.py", "tiled_mlp/core/kernels/generic.py", "tiled_mlp/strategies/fsdp2.py"):
        assert module in contents["wheel"], module

    for kind, wheel in wheels.items():
        target = installed(wheel, tmp_path / f"site-{kind}")
        result = run_from(tmp_path, RUNS, str(target))
        assert result.returncode == 0, f"{kind}: {result.stderr}"
        assert all(f.startswith(str(target)) for f in result.stdout.split()[:3]), (kind, result.stdout)

    # The sdist's tests, run on the installed sdist's wheel (its sources removed, so they cannot shadow it).
    for folder in FOLDERS:
        shutil.rmtree(unpacked / folder)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_shard_plan.py"],
                           cwd=unpacked, env={**os.environ, "PYTHONPATH": str(tmp_path / "site-sdist")},
                           capture_output=True, text=True, timeout=180)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    assert " passed" in tests.stdout
