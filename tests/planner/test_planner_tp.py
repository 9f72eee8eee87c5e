"""``tiled-mlp plan --tp N``: the settings planned under DTensor tensor parallelism, tiled or not (the step itself is
checked byte-exact against two real gloo ranks in ``integration_tests/test_planner_tp_honesty.py``), the degree
named in the output, and what is not modelled refused before any step."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402

from tiled_mlp.cli.main import main  # noqa: E402
from tiled_mlp.planner.step import Setting  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 64, 176, 256, 2


def _config_file(tmp_path, **overrides):
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096, **overrides)
    config.save_pretrained(tmp_path)
    return str(tmp_path / "config.json")


def _refusal(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        main(["plan", *argv])
    return capsys.readouterr().err


def test_plan_json_names_the_tp_degree_and_holds_the_ranks_share_of_the_sharded_weights(tmp_path, capsys):
    main(["plan", "--model", _config_file(tmp_path), "--seq", "256", "--budget", "1GiB", "--dtype", "float32",
          "--tp", "2", "--world-size", "2", "--checkpointing", "none", "--json"])
    records = json.loads(capsys.readouterr().out)
    assert records[0]["tensor_parallel"] == 2 and records[0]["data_parallel"] == 1
    point = next(r for r in records if r.get("seq") == 256)
    assert point["setting"] == "untiled+tp2"
    kv = HIDDEN // 4 * 2
    sharded = LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 3 * HIDDEN * INTER) + VOCAB * HIDDEN
    whole = VOCAB * HIDDEN + (2 * LAYERS + 1) * HIDDEN  # the embeddings and the norms
    # Float32 weights; Adam's two float32 moments for the rank's parameters.
    assert point["parts"]["weights"] == 4 * (sharded // 2 + whole)
    assert point["optimizer_bytes"] == 8 * (sharded // 2 + whole)


def test_tp_with_sequence_parallelism_is_refused(tmp_path, capsys):
    err = _refusal(capsys, "--model", _config_file(tmp_path), "--tp", "2", "--sp", "2", "--world-size", "4")
    assert "--tp 2 with --sp 2" in err and "not modelled" in err


def test_tp_plans_the_tiled_settings_with_the_tiling_on_the_rank_s_share(tmp_path, capsys):
    main(["plan", "--model", _config_file(tmp_path), "--seq", "2048", "--budget", "1GiB", "--dtype", "float32",
          "--tp", "2", "--world-size", "2", "--checkpointing", "layer", "--tiled", "4", "--tiled-loss", "4",
          "--tiled-norms", "--json"])
    records = json.loads(capsys.readouterr().out)
    held = {r["setting"]: r["parts"] for r in records if r.get("seq") == 2048}
    assert set(held) == {"untiled+ckpt+tp2", "tiled+ckpt+tp2", "tiled+norms+ckpt+tp2", "tiled-loss+ckpt+tp2",
                         "tiled+tiled-loss+ckpt+tp2", "tiled+tiled-loss+norms+ckpt+tp2"}
    # Each piece tiled takes its share off the rank's peak: the tiled MLPs and loss, then the norms.
    peak = {name: sum(parts.values()) for name, parts in held.items()}
    assert peak["tiled+tiled-loss+norms+ckpt+tp2"] < peak["tiled+tiled-loss+ckpt+tp2"] < peak["untiled+ckpt+tp2"]
    # The weights are the rank's share whatever is tiled.
    assert len({parts["weights"] for parts in held.values()}) == 1
    Setting(tiled=True, checkpointing=False, tiled_loss=True, tiled_norms=True, tp=2)


def test_tp_that_splits_a_head_or_ties_the_lm_head_is_refused(tmp_path, capsys):
    err = _refusal(capsys, "--model", _config_file(tmp_path), "--tp", "4", "--world-size", "4")
    assert "whole heads" in err
    err = _refusal(capsys, "--model", _config_file(tmp_path, tie_word_embeddings=True), "--tp", "2", "--world-size", "2")
    assert "ties its LM head" in err


def test_tp_with_zero3_is_refused(tmp_path, capsys):
    err = _refusal(capsys, "--model", _config_file(tmp_path), "--tp", "2", "--world-size", "4", "--backend", "zero3")
    assert "--backend zero3 is not modelled" in err


@pytest.mark.timeout(60)
def test_the_planners_fake_group_is_registered_again_after_destroy_process_group(tmp_path):
    # ``destroy_process_group()`` unregisters every group by name, the planner's fake group too: a plan made
    # after it must still resolve its mesh's group (in a process of its own: the registry is global).
    code = (
        "import torch.distributed as dist\n"
        "from tiled_mlp.planner.tensor_parallel import meta_mesh\n"
        "group = meta_mesh(2).get_group()\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "dist.destroy_process_group()\n"
        "assert meta_mesh(2).get_group() is group\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


@pytest.mark.timeout(60)
def test_a_group_of_another_registered_under_the_planners_name_is_refused(tmp_path):
    code = (
        "import torch.distributed as dist\n"
        "from torch.distributed.distributed_c10d import _register_process_group\n"
        "from tiled_mlp.planner.tensor_parallel import meta_mesh\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "_register_process_group('tiled_mlp_planner_tp4', dist.new_group([0]))\n"
        "try:\n"
        "    meta_mesh(4)\n"
        "except RuntimeError as error:\n"
        "    assert 'another process group is registered under that name' in str(error), error\n"
        "else:\n"
        "    raise AssertionError('a foreign group was used as the planner\\'s')\n"
        "dist.destroy_process_group()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)
