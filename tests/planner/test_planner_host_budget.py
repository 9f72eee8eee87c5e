"""The planner's host budget: checkpoint offload trades device memory for host memory, so a step fits
when the device holds it within ``budget`` and the host within ``host_budget``; the longest length then
fits both (found on the grid: it fits, a grid step more does not, for the host), in the plan, the CLI
(``--host-budget``) and ALST's ladder (a node's host memory shared by a row's ranks)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")


from integration_tests.tiny_models import planner_llama  # noqa: E402
from tiled_mlp.cli.main import main  # noqa: E402
from tiled_mlp.planner import alst  # noqa: E402
from tiled_mlp.planner.backends import Backend  # noqa: E402
from tiled_mlp.planner.plan import OFFLOADED, Planner, Point, Request  # noqa: E402
from tiled_mlp.planner.step import Setting  # noqa: E402

pytestmark = pytest.mark.timeout(300)

GiB, MiB = 2**30, 2**20
OFFLOAD = Setting(tiled=False, checkpointing=True, offload_checkpoints=True)
# planner_llama(3) in float32: two of its three layer inputs are offloaded, 2 x 64 x 4 = 512 bytes a token.
HOST_PER_TOKEN = 512


def test_a_point_fits_the_device_and_the_host():
    point = Point(1024, "x", 10.0, 0.0, {}, budget=20.0, host_parts={OFFLOADED: 30.0}, host_budget=40.0)
    assert point.fits and point.device_fits and point.host_fits and point.load() == 0.75
    over_host = Point(1024, "x", 10.0, 0.0, {}, budget=20.0, host_parts={OFFLOADED: 50.0}, host_budget=40.0)
    assert not over_host.fits and over_host.device_fits and not over_host.host_fits and over_host.load() == 1.25
    unlimited = Point(1024, "x", 10.0, 0.0, {}, budget=20.0, host_parts={OFFLOADED: 50.0})
    assert unlimited.fits and unlimited.load() == 0.5
    record = over_host.record()
    assert record["fits"] is False and record["host_fits"] is False and record["host_budget"] == 40


def _offload_planner(host_budget=None) -> Planner:
    return Planner(Request(planner_llama(3), [], [OFFLOAD], Backend("single", 1), dtype=torch.float32, budget=1 * GiB,
                           seq_step=256, seq_cap=8192, host_budget=host_budget))


def test_the_longest_length_fits_the_host_budget_too():
    """With the device far from full, 1 MiB of host memory for 512 bytes a token stops the search at 2048
    tokens: 2048 fits both, 2304 fits the device but not the host."""
    assert _offload_planner().longest(OFFLOAD).at_cap, "the device alone holds every length up to the cap"
    planner = _offload_planner(host_budget=1 * MiB)
    found = planner.longest(OFFLOAD)
    assert found.seq == 2048 and not found.at_cap
    at, past = planner.point(OFFLOAD, 2048), planner.point(OFFLOAD, 2048 + 256)
    assert at.host_parts[OFFLOADED] == 2048 * HOST_PER_TOKEN == 1 * MiB and at.fits
    assert past.device_fits and not past.host_fits and not past.fits


def test_the_cli_holds_the_host_budget_and_says_where_only_the_host_is_over(capsys, tmp_path):
    planner_llama(3).save_pretrained(tmp_path)
    argv = ["plan", "--model", str(tmp_path), "--seq", "1024,4096", "--dtype", "fp32", "--tiled", "none",
            "--tiled-loss", "none", "--checkpointing", "layer", "--budget", "1GiB", "--offload-checkpoints",
            "--host-budget", "1MiB"]
    assert main(argv + ["--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records[0]["host_budget_bytes"] == MiB
    at = {(r["seq"], r["setting"]): r for r in records if "seq" in r}
    assert at[(1024, "untiled+ckpt+offload")]["fits"] and at[(1024, "untiled+ckpt+offload")]["host_fits"]
    assert not at[(4096, "untiled+ckpt+offload")]["fits"] and not at[(4096, "untiled+ckpt+offload")]["host_fits"]
    longest = {r["setting"]: r["max_seq"] for r in records if "max_seq" in r}
    assert longest["untiled+ckpt+offload"] == 2048 and longest["untiled+ckpt"] > 2048
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "held against 1.00 GiB a rank" not in out and "held against 0.00 GiB a rank (--host-budget)" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| 4096 | untiled+ckpt+offload |")]
    assert row.split("|")[6].strip() == "no (host)"
    assert "within 1.00 GiB and 0.00 GiB of host memory per rank" in out


def test_the_ladder_shares_a_nodes_host_among_a_rows_ranks():
    """Two tiny rows with checkpoint offload under a node's 7 MiB of host memory: on two ranks each has 3.5 MiB
    and ALST's length is over on the host (the finding says so, not a device term); on one rank it has all
    7, and the longest stops where the host is full."""
    config = planner_llama(3)
    setting = Setting(tiled=False, checkpointing=True, tiled_loss=True, offload_checkpoints=True)
    rungs = [alst.Rung("two ranks", "10K", 10_000, setting, world_size=2, grid=256),
             alst.Rung("one rank", "4K", 4_000, setting, world_size=1, grid=256)]
    budget, node = 1.1 * GiB, 7 * MiB
    plain = alst.climb(config, rungs, budget=budget)
    climbed = alst.climb(config, rungs, budget=budget, node_host=node)
    for rung, c in zip(rungs, climbed, strict=True):
        assert c.point is not None and c.point.host_budget == node / rung.world_size
        assert c.point.fits and c.longest.seq < next(p for p in plain if p.rung is rung).longest.seq
    two, one = climbed
    assert two.at_alst.device_fits and not two.at_alst.host_fits and two.at_alst_peak is None
    text = "\n".join(alst.table(config, climbed, budget, "tiny", node) + alst.findings(config, climbed, budget))
    assert "0 GiB of host memory a node (shared by the row's ranks)" in text
    assert "fits the device, host over by" in text
    assert "short of ALST's 10K, for host memory" in text
    assert "ours stops where the host is full" in text


def test_when_only_the_host_is_over_the_advice_is_about_the_host(capsys, tmp_path):
    """Nothing fits a host budget of 1000 bytes: the advice names the host and its knobs (not the device's,
    which holds the step, nor more checkpoint offload, which would put more on the host)."""
    planner_llama(3).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--seq", "1024", "--dtype", "fp32", "--tiled", "none",
                 "--tiled-loss", "none", "--checkpointing", "layer", "--budget", "1GiB", "--offload-optimizer",
                 "--offload-checkpoints", "--host-budget", "1000B"]) == 0
    out = capsys.readouterr().out
    assert "of host memory per rank (--host-budget): at 1024 tokens untiled+ckpt" in out
    assert "- a larger --host-budget: at least" in out and "the optimizer state on the device" in out
    assert "--world-size" not in out and "try --offload-checkpoints" not in out
