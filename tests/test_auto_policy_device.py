"""The auto policy by device (``auto_shards.DeviceClass``): CUDA's rules tested here without a GPU, as
functions of a device description; the CPU's answers unchanged."""
import pytest
import torch

from tiled_mlp.bench.model_memory import modeled_step
from tiled_mlp.cli.plan_cmd import swiglu_size
from tiled_mlp.core import auto_shards
from tiled_mlp.core.auto_shards import (
    CPU,
    DeviceClass,
    auto_decision,
    auto_num_shards,
    device_class,
    modelled_as,
    remembered_auto_decision,
)

pytestmark = pytest.mark.timeout(180)

HOPPER, BLACKWELL, AMPERE = DeviceClass("cuda", (9, 0)), DeviceClass("cuda", (10, 0)), DeviceClass("cuda", (8, 0))
OTHERS = [AMPERE, DeviceClass("cuda"), DeviceClass("rocm"), DeviceClass("npu"), DeviceClass("xpu")]
SEED = swiglu_size(4096, 12288, torch.bfloat16)
SEQS = (2048, 8192, 32768, 131072)


def test_the_cpu_answers_are_todays():
    assert [auto_num_shards(seq, SEED) for seq in SEQS] == [None, 8, 25, 97]
    small = swiglu_size(1024, 2816, torch.float32)
    for seq in (1024, 4096, 8192, 16384):
        for size in (SEED, small):
            assert auto_decision(seq, size, CPU) == auto_decision(seq, size) == auto_decision(seq, size, CPU, True)


@pytest.mark.parametrize("device", [HOPPER, BLACKWELL])
def test_hopper_class_cuda_cuts_shards_of_at_least_3584_tokens(device):
    assert [auto_num_shards(seq, SEED, device) for seq in SEQS] == [None, 3, 10, 37]
    assert auto_decision(131072, SEED, device).reason == "tiled (37 shards of ~3543 tokens): saves ~11.7 GiB"


@pytest.mark.parametrize("device", OTHERS, ids=str)
def test_other_accelerators_take_2048_tokens_a_shard(device):
    assert [auto_num_shards(seq, SEED, device) for seq in SEQS] == [None, 4, 16, 64]


def test_hoppers_count_at_the_seeds_size_models_within_0_23_of_untiled():
    shards = auto_num_shards(131072, SEED, HOPPER)
    untiled, _ = modeled_step("untiled", 4096, 12288, 131072, torch.bfloat16)
    tiled, used = modeled_step("fast", 4096, 12288, 131072, torch.bfloat16, num_shards=shards)
    assert tiled / untiled <= 0.23, (shards, tiled / untiled)  # 0.2286; 32 shards (4096 tokens) model 0.231
    assert used == shards == 37


def test_compiled_cuda_calls_with_less_work_than_a_floor_shard_pass_through():
    small = swiglu_size(1024, 2816, torch.bfloat16)  # docs/gpu.md's compiled row: 4.28x tiled in 8 shards
    compiled = auto_decision(8192, small, HOPPER, compiling=True)
    assert compiled.num_shards is None
    assert compiled.reason == ("untiled: compiled on cuda, the call is less matmul work than one 3584-token shard "
                               "of a 4096 x 12288 MLP, so its shards would be launch-bound")
    assert auto_num_shards(8192, small, HOPPER) == 3  # eagerly it tiles
    assert auto_decision(8192, small, AMPERE, compiling=True).num_shards is None
    # Enough work for shards that are not launch-bound: tiled, compiled or not; and never on another device.
    assert auto_decision(131072, SEED, HOPPER, compiling=True).num_shards == 37
    assert auto_decision(16384, SEED, HOPPER, compiling=True).num_shards == 5
    assert auto_decision(8192, small, DeviceClass("npu"), compiling=True).num_shards == 4


def test_the_device_is_read_once_from_what_it_is(monkeypatch):
    assert device_class(torch.device("cpu")) == CPU
    assert device_class(torch.device("meta")) == device_class(None) == auto_shards.MODELLED_DEVICE == CPU
    monkeypatch.setattr(auto_shards, "_CLASSES", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    reads = []
    read = auto_shards._read_class
    monkeypatch.setattr(auto_shards, "_read_class", lambda device: reads.append(device) or read(device))
    for _ in range(3):
        assert device_class(torch.device("cuda", 0)) == HOPPER
    assert reads == [torch.device("cuda", 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CUDA faked on a machine without a GPU
    assert device_class(torch.device("cuda", 1)) == DeviceClass("cuda")
    monkeypatch.setattr(torch.version, "hip", "6.4")  # ROCm answers as "cuda" with capabilities of its own
    assert device_class(torch.device("cuda", 2)) == DeviceClass("rocm")
    assert device_class(torch.device("npu", 0) if hasattr(torch, "npu") else torch.device("xpu", 0)).capability is None


def test_the_remembered_answer_is_by_device_compiling_and_the_device_floors(monkeypatch):
    sizes = (8192, 1024, 2816, 3 * 1024 * 2816 * 2, 2, None)
    assert remembered_auto_decision(*sizes).num_shards == 8
    assert remembered_auto_decision(*sizes, HOPPER).num_shards == 3
    assert remembered_auto_decision(*sizes, HOPPER, True).num_shards is None
    with modelled_as(HOPPER):  # a caller that names no device: the modelled one
        assert remembered_auto_decision(*sizes).num_shards == 3
    assert remembered_auto_decision(*sizes).num_shards == 8
    monkeypatch.setattr(auto_shards, "MIN_TOKENS_PER_SHARD_BY_DEVICE", (("hopper", 4096), ("accelerator", 2048)))
    assert remembered_auto_decision(*sizes, HOPPER).num_shards == 2


def test_the_planners_step_cuts_the_shards_the_policy_gives_its_device():
    """The planner models a device's step with that device's answers: its pass-through rule (``pass_through.py``)
    and the shard counts its modelled step's tiled MLPs run are the policy's for the modelled device."""
    pytest.importorskip("transformers")
    from tiled_mlp.planner.backends import Backend
    from tiled_mlp.planner.plan import Planner, Request
    from tiled_mlp.planner.presets import load_config
    from tiled_mlp.planner.step import Setting, step_timeline

    config = load_config("llama-3.1-8b")
    config.num_hidden_layers = 2
    setting = Setting(tiled=True, checkpointing=True)
    llama = swiglu_size(4096, 14336, torch.bfloat16)
    for device in (CPU, HOPPER):
        with modelled_as(device):
            planner = Planner(Request(config, [], [setting], Backend("single", 1), budget=80 * 2**30))
            # 3072 tokens: 3 shards on the CPU; on Hopper one shard, which frees nothing, so untiled.
            assert (planner.pass_through_twin(setting, 3072) is None) == (auto_num_shards(3072, llama, device) == 3)
            model = planner.model(setting)
            step_timeline(model, 8192, 1, replay_shards=False)
            counts = {m.tiling.last_num_shards for m in model.modules() if hasattr(m, "tiling")}
            assert counts == {auto_num_shards(8192, llama, device)} == {3 if device == HOPPER else 8}, device


def test_a_gpu_plan_decides_its_steps_as_a_hopper_gpu_and_a_cpu_plan_as_the_cpu():
    """``Request.gpu`` (the CLI's plans, ALST's ladder) picks the shard policy with the attention workspace:
    the plan's own steps follow it, with no context from the caller."""
    pytest.importorskip("transformers")
    from tiled_mlp.planner.backends import Backend
    from tiled_mlp.planner.plan import Planner, Request
    from tiled_mlp.planner.presets import load_config
    from tiled_mlp.planner.step import Setting

    config = load_config("llama-3.1-8b")
    config.num_hidden_layers = 2
    setting = Setting(tiled=True, checkpointing=True)
    llama = swiglu_size(4096, 14336, torch.bfloat16)
    for gpu, device in ((False, CPU), (True, HOPPER)):
        planner = Planner(Request(config, [], [setting], Backend("single", 1), budget=80 * 2**30, gpu=gpu))
        assert planner.shard_device() == device
        assert (planner.pass_through_twin(setting, 3072) is None) == (auto_num_shards(3072, llama, device) == 3)
        planner.timeline(setting, 8192, full_depth=True, replay_shards=False)
        model = planner.model(setting)
        counts = {m.tiling.last_num_shards for m in model.modules() if hasattr(m, "tiling")}
        assert counts == {auto_num_shards(8192, llama, device)} == {3 if gpu else 8}, device
    assert auto_shards.MODELLED_DEVICE == CPU  # put back after each step


def test_a_module_call_follows_its_devices_policy_eager_and_compiled(monkeypatch):
    # The CPU read as a Hopper GPU: the call asks the policy for its input's device, and the compiled route's
    # decision is not the eager one's (the memo is keyed by compiling).
    monkeypatch.setattr(auto_shards, "MIN_SAVED_BYTES", 0)  # small sizes, so that compiling is quick
    monkeypatch.setattr(auto_shards, "_CLASSES", {torch.device("cpu"): DeviceClass("cuda", (9, 0))})
    from tiled_mlp import TiledMLP
    from tiled_mlp.bench.mlp import SwiGLUMLP

    torch.manual_seed(0)
    mlp = TiledMLP(SwiGLUMLP(64, 176))
    x = torch.randn(1, 8192, 64)
    mlp(x)
    assert (mlp.tiling.last_path, mlp.tiling.last_num_shards) == ("fast", 3), mlp.tiling.last_reason
    torch._dynamo.reset()
    torch.compile(mlp)(x)
    assert mlp.tiling.last_path == "untiled", mlp.tiling.compiled_reason
    assert "launch-bound" in mlp.tiling.compiled_reason
    mlp(x)
    assert (mlp.tiling.last_path, mlp.tiling.last_num_shards) == ("fast", 3)
    torch._dynamo.reset()
