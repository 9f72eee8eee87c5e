"""The planner beyond tiling: checkpoint offload (its modelled step equals a real CPU step to the byte,
device and host memory each, at every allocation), Ulysses SP (one rank's step on the meta device with
DeepSpeed's own attention class; the two-rank real check is ``integration_tests/test_planner_sp_honesty.py``),
ZeRO-3's parameter offload (analytic), the host memory column, the errors before any work, and ALST's
ladder where it ends: Llama-3.1-8B on 8 ranks with everything and on one GPU with the parameters on
the host, each a little short of ALST's figure, for the term said in the README, and about twice it with
this library's tiled RMSNorms in place of that term."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from planner_checks import predicted_to_the_byte  # noqa: E402

from integration_tests.tiny_models import planner_llama  # noqa: E402
from tiled_mlp.cli.main import main  # noqa: E402
from tiled_mlp.planner import alst  # noqa: E402
from tiled_mlp.planner.backends import Backend  # noqa: E402
from tiled_mlp.planner.plan import OFFLOADED, Planner, Request  # noqa: E402
from tiled_mlp.planner.presets import load_config  # noqa: E402
from tiled_mlp.planner.step import Setting, offload_of  # noqa: E402

pytestmark = pytest.mark.timeout(300)

GiB = 2**30
SEQ = 1024
OFFLOADED_SETTINGS = {s.name: s for s in (
    Setting(tiled=False, checkpointing=True, offload_checkpoints=True),
    Setting(tiled=True, checkpointing=True, num_shards=4, tiled_loss=True, loss_num_shards=4, offload_checkpoints=True),
)}


@pytest.mark.parametrize("name", list(OFFLOADED_SETTINGS))
def test_a_real_step_with_checkpoint_offload_is_predicted_to_the_byte_on_device_and_host(name):
    """The real ``apply_checkpoint_offload`` runs in both steps; its host copies are counted apart."""
    setting, config = OFFLOADED_SETTINGS[name], planner_llama(3)
    planner, real, measured = predicted_to_the_byte(setting, config, SEQ)
    predicted = planner.timeline(setting, SEQ)
    one_input = SEQ * config.hidden_size * 4
    # Layers 0 and 1 offloaded, the last kept; the offload's own count says the same.
    assert measured.host_peak() == predicted.host_peak() == 2 * one_input == offload_of(real).host_bytes.peak
    point = planner.point(setting, SEQ)
    assert point.host_parts == {OFFLOADED: 2 * one_input} and point.host_bytes == 2 * one_input
    # Each offloaded input comes back as a device tensor of its own for its layer's recompute, as from a
    # GPU's host memory (a float32 [1, 1024, 64] copy has no other source in this float32 step).
    described = planner.timeline(setting, SEQ, describe=True)
    back = [w for w in described.what.values() if w == "aten._to_copy.default float32 [1, 1024, 64]"]
    assert len(back) == 2


def test_offload_moves_the_checkpointed_inputs_off_the_device():
    """Llama-3.1-8B at 131072 tokens: 31 layer inputs (1 GiB each in bfloat16) leave the device; the step's
    peak falls by 19.4 GiB, not 31 (it moves to another moment, where fewer of them were alive)."""
    config = load_config("llama-3.1-8b")
    kept = Setting(tiled=True, checkpointing=True, tiled_loss=True)
    moved = Setting(tiled=True, checkpointing=True, tiled_loss=True, offload_checkpoints=True)
    planner = Planner(Request(config, [], [kept, moved], Backend("single", 1), budget=80 * GiB,
                              optimizer_on_device=False))
    before, after = planner.point(kept, 131072), planner.point(moved, 131072)
    assert after.host_parts[OFFLOADED] == 31 * 131072 * 4096 * 2
    assert 19 * GiB < before.held_bytes - after.held_bytes < 31 * GiB
    assert after.host_parts["optimizer"] == before.host_parts["optimizer"] == before.optimizer_bytes


def test_a_sequence_parallel_rank_runs_its_share_of_tokens_with_deepspeeds_exchanges():
    """SP=2 on the meta device: the rank's step runs 512 of 1024 tokens, DeepSpeed's all-to-all makes its
    buffers (4 per layer forward: q, k, v in, the output back), and deepspeed.comm is left as it was."""
    import deepspeed.comm.comm as ds_comm

    config = planner_llama(3)
    setting = Setting(tiled=False, checkpointing=False, sp=2)
    planner = Planner(Request(config, [SEQ], [setting], Backend("zero3", 2), dtype=torch.float32))
    before = ds_comm.cdb
    timeline = planner.timeline(setting, SEQ, describe=True)
    assert ds_comm.cdb is before
    exchanges = [w for w in timeline.what.values() if w.startswith("deepspeed.dim_zero_all_to_all")]
    # Forward: q, k, v and the output per layer; backward: their gradients again.
    assert len(exchanges) == 2 * 4 * config.num_hidden_layers
    assert "deepspeed.dim_zero_all_to_all.default float32 [2, 512, 1, 2, 16]" in exchanges  # q: [sp, tokens/sp, b, heads/sp, d]
    point = planner.point(setting, SEQ)
    assert point.tokens_per_rank == 512 and setting.name == "untiled+sp2"
    plain = Planner(Request(config, [SEQ], [Setting(False, False)], Backend("zero3", 2), dtype=torch.float32))
    assert point.peak_bytes < plain.point(Setting(False, False), SEQ).peak_bytes


def test_zero3_parameter_offload_is_analytic_and_leaves_the_device_no_partition():
    """DeepSpeed's stage 3 with offload_param and offload_optimizer to the CPU (ALST's one-GPU run)."""
    config = load_config("llama-3.1-8b")
    setting = Setting(tiled=True, checkpointing=True, tiled_loss=True)
    on_device = Planner(Request(config, [], [setting], Backend("zero3", 1), budget=80 * GiB, optimizer_on_device=False))
    on_host = Planner(Request(config, [], [setting], Backend("zero3", 1, offload_params=True), budget=80 * GiB,
                              optimizer_on_device=False))
    sizes = on_host.param_sizes()
    a, b = on_device.point(setting, 8192), on_host.point(setting, 8192)
    assert a.parts["weights"] == sizes.total * 2 and b.parts["weights"] == 0
    assert a.parts["gradients"] == b.parts["gradients"] == 0, "the optimizer runs on the host: so do the gradients"
    assert b.host_parts == {"optimizer": sizes.total * 12, "gradients": sizes.total * (2 + 4), "weights": sizes.total * 2}
    element = 2
    in_flight = (sizes.persistent + 2 * sizes.largest_module + 5e7 + 5e8) * element
    assert b.parts["backend in flight"] == pytest.approx(in_flight)
    assert 0 < sizes.persistent < 300_000, "the norms' weights: never partitioned"


@pytest.mark.parametrize("argv, expect", [
    (["--sp", "3", "--world-size", "3", "--seq", "3072"], "--sp 3: llama has 32 query heads"),
    (["--model", "qwen2.5-7b", "--sp", "7", "--world-size", "7", "--seq", "7168"], "--sp 7: qwen2 has 4 key/value heads"),
    (["--sp", "4", "--world-size", "6"], "--world-size 6 is not a multiple of 4"),
    (["--sp", "4", "--world-size", "4", "--seq", "8190"], "8190 tokens do not split across 4 ranks"),
    (["--offload-checkpoints", "--checkpointing", "none"], "with --checkpointing none there is none"),
    (["--sp", "2", "--world-size", "2", "--tiled-loss", "none"], "apply_sequence_parallel requires the tiled loss"),
    (["--model", "qwen3-30b-a3b", "--sp", "2", "--world-size", "2"], "apply_sequence_parallel refuses Qwen3MoeForCausalLM"),
    (["--offload-params", "--backend", "fsdp2"], "--offload-params is ZeRO-3's offload_param"),
])
def test_bad_parallel_options_are_refused_before_any_step(capsys, monkeypatch, argv, expect):
    from tiled_mlp.planner import check
    from tiled_mlp.planner import plan as plan_module

    def no_work(*args, **kwargs):
        raise AssertionError("a step was modelled before the arguments were checked")

    monkeypatch.setattr(plan_module, "step_timeline", no_work)
    monkeypatch.setattr(check, "step_timeline", no_work)
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-3.1-8b", "--backend", "zero3", *argv])  # a later --model wins
    assert expect in capsys.readouterr().err


def test_offload_without_checkpointing_is_no_setting():
    with pytest.raises(ValueError, match="without layer checkpointing there is no such input"):
        Setting(tiled=True, checkpointing=False, offload_checkpoints=True)
    with pytest.raises(ValueError, match="parameter offload is ZeRO-3's"):
        Backend("fsdp2", 8, offload_params=True)


def test_the_cli_reports_host_memory_and_plans_offload_beside_each_checkpointed_setting(capsys, tmp_path):
    planner_llama(3).save_pretrained(tmp_path)
    argv = ["plan", "--model", str(tmp_path), "--seq", "1024", "--dtype", "fp32", "--tiled", "none",
            "--tiled-loss", "auto", "--budget", "64MiB", "--world-size", "2", "--backend", "zero3", "--sp", "2",
            "--offload-checkpoints", "--offload-optimizer"]
    assert main(argv + ["--json"]) == 0
    records = [r for r in json.loads(capsys.readouterr().out) if "seq" in r]
    # Only the tiled-loss settings: apply_sequence_parallel requires the tiled loss.
    assert [r["setting"] for r in records] == ["tiled-loss+sp2", "tiled-loss+ckpt+sp2", "tiled-loss+ckpt+offload+sp2"]
    for r in records:
        assert r["tokens_per_rank"] == 512 and r["host_bytes"] == sum(r["host_parts"].values())
        assert set(r["host_parts"]) >= {"optimizer", "gradients"}
    assert records[2]["host_parts"][OFFLOADED] == 2 * 512 * 64 * 4 and OFFLOADED not in records[1]["host_parts"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| held | fits | host |" in out and "'host' is the rank's host memory" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| 1024 | tiled-loss+ckpt+offload+sp2 |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert len(cells) == 8 and cells[6] == f"{records[2]['host_bytes'] / GiB:.2f}", cells
    assert "Ulysses SP over 2 ranks" in out and "'spN' is Ulysses" in out


def test_the_ladder_is_rendered_from_its_rows():
    """The ladder's table and findings on a tiny model and budget (the real one: ``tiled-mlp plan --alst``)."""
    config = planner_llama(3)
    rungs = [alst.Rung("short", "2K", 2_000, Setting(tiled=False, checkpointing=True, tiled_loss=True, sp=2),
                       world_size=2, grid=256),
             alst.Rung("long", "100K", 100_000, Setting(tiled=False, checkpointing=True, tiled_loss=True,
                                                        offload_checkpoints=True), world_size=1, offload_params=True,
                       grid=256)]
    budget = 1.1 * GiB  # ZeRO-3's buckets alone are 1.03 GiB in bfloat16
    climbed = alst.climb(config, rungs, budget=budget)
    assert climbed[0].longest.at_cap and climbed[0].at_alst.fits and climbed[0].at_alst_peak is None
    assert climbed[1].longest.seq < 100_000 and not climbed[1].at_alst.fits and climbed[1].at_alst_peak
    text = "\n".join(alst.table(config, climbed, budget, "tiny") + alst.findings(config, climbed, budget))
    assert "| short | tiled-loss+ckpt+sp2 | 2 | 2K | at least 5,120 |" in text and "past ALST's 2K" in text
    assert "short of ALST's 100K" in text and "live at that step's peak, by dtype and last dimension" in text
    assert "ALST's runs" in text
    assert json.dumps(alst.records(climbed))


def test_plan_alst_prints_the_ladder_and_its_records(capsys, monkeypatch, tmp_path):
    """The command's own path, on a tiny model and budget (the real ladder takes about ten minutes)."""
    planner_llama(3).save_pretrained(tmp_path)
    monkeypatch.setattr(alst, "MODEL", str(tmp_path))
    monkeypatch.setattr(alst, "RUNGS", [alst.Rung("tiny", "4K", 4_000, Setting(tiled=True, checkpointing=True,
                                                                                tiled_loss=True, sp=2), grid=512)])
    assert main(["plan", "--alst", "--budget", "1.1GiB"]) == 0
    out = capsys.readouterr().out
    assert f"ALST's ladder, modelled: {tmp_path}, bfloat16, batch 1, 1.1 GiB a rank" in out
    assert "| tiny | tiled+tiled-loss+ckpt+sp2 | 8 | 4K |" in out and "modelled in" in out
    assert main(["plan", "--alst", "--budget", "1.1GiB", "--json"]) == 0
    head, row = json.loads(capsys.readouterr().out)
    assert head["budget_bytes"] == int(1.1 * GiB) and row["setting"] == "tiled+tiled-loss+ckpt+sp2"
    assert row["max_seq"] % 512 == 0 and row["at_max"]["tokens_per_rank"] == row["max_seq"] // 2


@pytest.mark.parametrize("rung, ours", [(alst.RUNGS[5], 3_645_440), (alst.RUNGS[6], 490_496)],
                         ids=["8 ranks, SP=8, everything", "1 GPU, parameters on the host"])
def test_alsts_last_rungs_end_a_step_short_for_hugging_faces_float32_rmsnorm(rung, ours):
    """ALST: 3.7M tokens on 8 ranks, 500K on one GPU. Ours: 1.5% and 1.9% shorter, each the longest on its
    grid (it fits, a grid step more does not). At ALST's length the step's peak is in a decoder layer's
    backward, and the float32 [tokens, hidden] tensors of Hugging Face's LlamaRMSNorm (it upcasts its input,
    and its backward works in float32) are the largest family live there: the term that makes the
    difference (ALST ran Liger-Kernel, whose fused RMSNorm keeps none of them)."""
    config = load_config(alst.MODEL)
    planner = alst.planner_for(config, rung)
    step = planner.seq_step(rung.setting)
    assert planner.fits(rung.setting, ours) and not planner.fits(rung.setting, ours + step)
    at_alst = planner.point(rung.setting, alst.alst_seq(planner, rung))
    assert not at_alst.fits and at_alst.dominant == "activations"
    assert at_alst.held_bytes < 82 * GiB, "a little over, not far"
    peak = alst.families(config, planner.peak_allocations(rung.setting, at_alst.seq), rung.setting.sp)
    largest, amount = next(iter(peak.items()))
    assert largest == "float32 [tokens, hidden]" and amount > 0.5 * at_alst.parts["activations"]


@pytest.mark.slow  # two full-scale points of thousands of tiled shards each: minutes, `pytest -m slow`
@pytest.mark.timeout(600)
@pytest.mark.parametrize("rung, ours", [(alst.RUNGS[7], 6_512_640), (alst.RUNGS[8], 834_560)],
                         ids=["8 ranks, SP=8, everything + tiled norms", "1 GPU + tiled norms"])
def test_with_tiled_norms_alsts_rows_reach_well_past_its_lengths(rung, ours):
    """The same two rows with this library's tiled RMSNorms (the float32 term gone) on a node of 2 TB
    of host memory, with FlashAttention-2's own workspace held while each attention backward runs (the
    peak there): 6,512,640 tokens on 8 ranks and 834,560 on one GPU, 1.76 and 1.67 of ALST's lengths, each
    the longest on its grid, where the device fills first."""
    config = load_config(alst.MODEL)
    planner = alst.planner_for(config, rung, node_host=2e12)
    step = planner.seq_step(rung.setting)
    at, past = planner.point(rung.setting, ours), planner.point(rung.setting, ours + step)
    assert at.fits and not past.fits
    assert not past.device_fits and past.host_fits
    assert ours > 1.6 * rung.alst_tokens


def test_the_tiled_norms_rows_step_is_composed_as_its_full_depth_step():
    """The path of ALST's tiled-norms rows (tiled MLPs, loss and norms, checkpoint offload, SP, ZeRO-3 with
    the parameters on the host), on a tiny model: the composed step is the full-depth one, event for event
    (the real rows, at millions of tokens, are the slow tests above)."""
    config = planner_llama(5)
    setting = Setting(tiled=True, checkpointing=True, tiled_loss=True, offload_checkpoints=True, sp=2,
                      tiled_norms=True)
    rung = alst.Rung("tiny", "4K", 4_000, setting, world_size=2, offload_params=True, grid=256)
    planner = alst.planner_for(config, rung, budget=1.1 * GiB, node_host=1 * GiB)
    composed, full = planner.timeline(setting, 2048), planner.timeline(setting, 2048, full_depth=True)
    assert len(planner.stepped(setting)) == 2
    assert composed.points == full.points and composed.host == full.host and composed.host_peak() > 0
