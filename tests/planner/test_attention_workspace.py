"""The GPU attention kernels' own workspace (``tiled_mlp/planner/attention_workspace.py``): each backend's
bytes against the allocations its source documents, worked out by hand here, for MHA, GQA and MQA, 16- and
32-bit dtypes, lengths that round, and Ulysses SP; and a GPU plan's step holding it while each layer's
attention backward runs, beside everything that backward reads, and nowhere else (a CPU plan unchanged)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from integration_tests.tiny_models import small_planner_llama  # noqa: E402
from tiled_mlp.planner import alst, attention  # noqa: E402
from tiled_mlp.planner import attention_workspace as aw  # noqa: E402
from tiled_mlp.planner.backends import Backend  # noqa: E402
from tiled_mlp.planner.plan import Planner, Request  # noqa: E402
from tiled_mlp.planner.presets import load_config  # noqa: E402
from tiled_mlp.planner.step import Setting  # noqa: E402

pytestmark = pytest.mark.timeout(120)

F32, BF16 = 4, 2
LAYOUTS = {"MHA": 32, "GQA": 8, "MQA": 1}  # key/value heads beside 32 query heads


def call(kv_heads=32, seq=4096, heads=32, head_dim=128, dtype=torch.bfloat16, batch=1) -> aw.Call:
    return aw.Call(batch, seq, seq, heads, kv_heads, head_dim, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, size", [(torch.bfloat16, 2), (torch.float16, 2)])
def test_flash_attention_2_holds_a_float32_dq_accumulator_and_under_grouped_heads_expanded_dk_dv(layout, dtype, size):
    kv = LAYOUTS[layout]
    got = aw.flash_attention_2(call(kv, seq=4096, dtype=dtype, batch=2))
    dq_accum = 2 * 4096 * 32 * 128 * F32  # [b, round(s, 128), h, round(d, 32)] float32
    softmax_d = 2 * 32 * 4096 * F32  # [b, h, round(s, 128)] float32
    expanded = 0 if kv == 32 else 2 * (2 * 4096 * 32 * 128 * size)  # dk and dv, [b, s, h, d], every query head
    assert (got.forward, got.backward) == (0, dq_accum + softmax_d + expanded)
    assert aw.sdpa_flash(call(kv, seq=4096, dtype=dtype, batch=2)).backward == got.backward


@pytest.mark.parametrize("seq, head_dim, rows, d_rounded", [(1000, 128, 1024, 128), (129, 80, 256, 96),
                                                           (4097, 72, 4224, 96), (300, 192, 384, 192)])
def test_flash_attention_2_rounds_the_queries_to_128_and_the_head_dim_to_32_or_64(seq, head_dim, rows, d_rounded):
    got = aw.flash_attention_2(call(32, seq=seq, head_dim=head_dim))
    assert got.backward == rows * 32 * d_rounded * F32 + rows * 32 * F32


def test_flash_attention_2_varlen_pads_each_sequence_by_128_rows_not_to_128():
    got = aw.flash_attention_2(call(8, seq=1000, batch=3), varlen=True)
    rows = 3 * 1000 + 128 * 3
    assert got.backward == rows * 32 * 128 * F32 + rows * 32 * F32 + 2 * 3 * 1000 * 32 * 128 * BF16


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flash_attention_3_accumulates_grouped_dk_dv_in_float32_per_key_head(layout):
    kv = LAYOUTS[layout]
    got = aw.flash_attention_3(call(kv, seq=1000))
    q_rows = 1024  # round(1000, kBlockM 64): causal, head dim 128 on sm90
    expected = (q_rows * 32 * 128 * F32 + 2 * q_rows * 32 * F32 + 16 * 32 * 4  # dq_accum, softmax_d + lse_log2, semaphore
                + (0 if kv == 32 else 2 * kv * 1024 * 128 * F32))  # dk/dv_accum, round(1000, kBlockN 128)
    assert got.backward == expected


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, size", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_the_memory_efficient_backward_keeps_gradq_tiles_with_their_locks(layout, dtype, size):
    kv = LAYOUTS[layout]
    got = aw.sdpa_efficient(call(kv, seq=1000, dtype=dtype))
    gq = 16 * 1 * (16 + 64 * 128 * 4) // 4  # ceil(1000/64) tiles x ceil(128/128) columns, 16 B lock + 64x128 floats
    gkv = 2 * 128 * 128 if size == 2 else 0  # per-split dK/dV tiles (16-bit output only), one split
    expanded = 0 if kv == 32 else 2 * 1000 * 32 * 128 * size
    assert got.backward == 32 * (gq + gkv) * F32 + expanded
    assert got.forward == 0


def test_the_memory_efficient_forward_accumulates_in_float32_above_head_dim_128():
    got = aw.sdpa_efficient(call(32, seq=1000, head_dim=256))
    assert got.forward == 1000 * 32 * 256 * F32


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cudnn_and_flex_hold_their_documented_float32_buffers(layout):
    kv = LAYOUTS[layout]
    assert aw.sdpa_cudnn(call(kv, seq=1000)).backward == 1000 * 32 * 128 * F32 + 1000 * 32 * F32  # unrounded
    assert aw.flex_attention(call(kv, seq=1000)).backward == 1000 * 32 * F32  # delta only: GQA in the kernel


@pytest.mark.parametrize("sp, heads, kv_heads", [(1, 32, 8), (4, 8, 2), (8, 4, 1), (16, 2, 1)])
def test_under_ulysses_each_rank_runs_the_whole_sequence_for_its_share_of_the_heads(sp, heads, kv_heads):
    config = load_config("llama-3.1-8b")  # 32 query heads, 8 key/value heads, head dim 128
    got = aw.for_config(config, 65536, sp=sp)
    assert got == aw.sdpa_flash(aw.Call(1, 65536, 65536, heads, kv_heads, 128))
    assert got.backward == 65536 * heads * 128 * F32 + 65536 * heads * F32 + 2 * 65536 * heads * 128 * BF16


def test_for_config_picks_the_kernel_a_cuda_step_runs():
    config = load_config("llama-3.1-8b")
    assert aw.for_config(config, 8192, attention="eager") is None
    assert aw.for_config(config, 8192, attention="flash_attention_2").backend == aw.FA2
    assert aw.for_config(config, 8192, dtype=torch.float32).backend == aw.SDPA_EFFICIENT  # flash takes 16 bits only
    assert aw.for_config(config, 8192, backend=aw.FA3).backend == aw.FA3


def test_a_call_the_kernels_cannot_make_is_refused():
    with pytest.raises(ValueError, match="do not divide"):
        call(kv_heads=5)
    with pytest.raises(ValueError, match="whole number"):
        call(seq=0)
    with pytest.raises(ValueError, match="choose one of flash_attention_2"):
        aw.workspace("xformers", call())
    with pytest.raises(ValueError, match="divisible by 3"):
        aw.ulysses_call(1, 1024, 32, 8, 128, sp=3)


# -- the planner: where on the step's timeline ---------------------------------------------------------

SETTING = Setting(tiled=True, checkpointing=True, num_shards=2, tiled_loss=True, tiled_norms=True)
SEQ = 256


def workspace_planner(gpu: bool, layers: int = 4, attention_choice: str = "sdpa") -> Planner:
    return Planner(Request(small_planner_llama(layers), [SEQ], [SETTING], Backend("single", 1), dtype=torch.bfloat16,
                           gpu=gpu, attention=attention_choice))


def _workspace_events(timeline):
    return [i for i, e in enumerate(timeline.events) if e[2] and "uint8" in e[3]]


@pytest.mark.parametrize("choice", ["sdpa", "flash_attention_2"])
def test_a_gpu_plan_is_the_cpu_plan_with_one_transient_workspace_per_layer(choice):
    cpu, gpu = (workspace_planner(g, attention_choice=choice).timeline(SETTING, SEQ, describe=True) for g in (False, True))
    marks = _workspace_events(gpu)
    assert len(marks) == 4 and not _workspace_events(cpu)
    # Each is freed as soon as it is made, and nothing else in the step changes: the same storages, and after
    # every other allocation the same bytes live (a backward's saved tensors may be freed in another order
    # between two allocations).
    assert all(gpu.events[i + 1][:3] == (gpu.events[i][0], gpu.events[i][1], False) for i in marks)
    kept = [e for i, e in enumerate(gpu.events) if i not in marks and i - 1 not in marks]
    assert sorted(kept) == sorted(cpu.events)
    allocations = [i for i, e in enumerate(gpu.events) if e[2]]
    at_marks = {allocations.index(i) for i in marks}
    assert [p for n, p in enumerate(gpu.points) if n not in at_marks] == cpu.points
    config = small_planner_llama(4)
    expected = aw.for_config(config, SEQ, attention=choice).backward
    assert all(gpu.events[i][1] == expected for i in marks)


def test_the_workspace_is_held_beside_everything_the_attention_backward_reads(monkeypatch):
    """Made large enough to be the peak: live with it are the backward's gradients and the saved query,
    key, value, output and log-sum-exp (a GPU kernel reads them while its buffers are held)."""
    huge = 2**40
    monkeypatch.setitem(aw.BACKENDS, aw.SDPA_FLASH, lambda c: aw.Workspace(aw.SDPA_FLASH, 0, huge))
    p = workspace_planner(True)
    timeline = p.timeline(SETTING, SEQ, describe=True)
    live = timeline.at_peak()
    labels = " | ".join(live)
    assert next(iter(live.values())) == huge and attention.is_workspace(next(iter(live)))
    assert alst.families(small_planner_llama(4), live, 1)["the attention kernel's own workspace"] == huge
    assert "_scaled_dot_product_flash_attention_for_cpu_backward.default bfloat16 [1, 4, 256, 16]" in labels  # dq
    assert "_scaled_dot_product_flash_attention_for_cpu_backward.default bfloat16 [1, 2, 256, 16]" in labels  # dk, dv
    assert "_scaled_dot_product_flash_attention_for_cpu.default bfloat16 [1, 4, 256, 16]" in labels  # the saved output
    assert "_scaled_dot_product_flash_attention_for_cpu.default float32 [1, 4, 256]" in labels  # its log-sum-exp
    assert "aten.add.Tensor bfloat16 [1, 4, 256, 16]" in labels  # the saved query (after its rotary embedding)
    assert timeline.peak()[0] - huge <= workspace_planner(False).timeline(SETTING, SEQ).peak()[0]  # live then: within the step


def test_the_peak_rises_only_by_what_the_workspace_adds_at_its_moment():
    """The transient at its moment, not added to the peak: with Llama-3.1-8B's heads at 4 layers and the
    whole stack, the peak (the attention backward, with the workspace) rises by less than the workspace."""
    config = load_config("llama-3.1-8b")
    setting = Setting(tiled=True, checkpointing=True, tiled_loss=True, tiled_norms=True)
    peaks = []
    for gpu in (False, True):
        p = Planner(Request(config, [], [setting], Backend("single", 1), gpu=gpu))
        peaks.append(p.timeline(setting, 16384).peak()[0])
    held = aw.for_config(config, 16384).backward
    assert peaks[0] <= peaks[1] < peaks[0] + held


def test_the_composed_gpu_step_is_its_full_depth_step():
    p = workspace_planner(True, layers=5)
    composed, full = p.timeline(SETTING, SEQ), p.timeline(SETTING, SEQ, full_depth=True)
    assert len(p.stepped(SETTING)) == 2
    assert composed.points == full.points


def test_eager_attention_adds_no_workspace_and_the_plan_names_the_kernel():
    assert not _workspace_events(workspace_planner(True, attention_choice="eager").timeline(SETTING, SEQ, describe=True))
    note = attention.workspace_note(load_config("llama-3.1-8b"), "sdpa", 131072)
    assert note is not None and note.startswith("attention workspace")
    assert "sdpa's flash backend (FlashAttention-2) backward, 4.02 GiB" in note and "131,072 tokens" in note
    sp8 = attention.workspace_note(load_config("llama-3.1-8b"), "flash_attention_2", 131072, sp=8)
    tp8 = attention.workspace_note(load_config("llama-3.1-8b"), "flash_attention_2", 131072, tp=8)
    assert sp8 == tp8 and "backward, 0.50 GiB" in str(tp8) and "per rank (its 1/8 of the heads" in str(tp8)
    assert attention.workspace_note(load_config("llama-3.1-8b"), "eager", 131072) is None
