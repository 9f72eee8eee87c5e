"""The planner counts the CPU generator states the generic tiled path saves per shard as host memory, to
the byte of a real CPU step's, for as long as the step holds them; the fast path saves none."""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, List

import pytest
import torch

pytest.importorskip("transformers")

from planner_checks import predicted_to_the_byte  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

import tiled_mlp.core.kernels.generic  # noqa: E402
import tiled_mlp.core.sharded_autograd  # noqa: E402
from integration_tests.tiny_models import small_planner_llama  # noqa: E402
from tiled_mlp.planner.step import Setting, build_model  # noqa: E402
from tiled_mlp.planner.timeline import GENERATOR_STATES  # noqa: E402

SEQ = 48
TILED = Setting(tiled=True, checkpointing=False, num_shards=3)
TILED_CHECKPOINTED = Setting(tiled=True, checkpointing=True, num_shards=4, tiled_loss=True)


def _gated_with_dropout(self, x):
    # Llama's MLP with dropout: random numbers the recompute must draw again, so the generic path.
    return self.down_proj(torch.nn.functional.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x), 0.1, self.training))


class LiveStates:
    """The bytes of the CPU generator states the tiled path captured and still holds, and their most."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.captured = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def seen(self, state: torch.Tensor) -> None:
        nbytes = state.untyped_storage().nbytes()
        self.captured += 1
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(state.untyped_storage(), self._freed, nbytes)


@contextlib.contextmanager
def states_counted(monkeypatch) -> Iterator[LiveStates]:
    """Every ``capture_rng_state`` of the tiled path (both its call sites and ``replay_rng_state``'s own)."""
    original = tiled_mlp.core.sharded_autograd.capture_rng_state
    states = LiveStates()

    def counted(device):
        state = original(device)
        states.seen(state[0])
        return state

    with monkeypatch.context() as patch:
        for module in (tiled_mlp.core.sharded_autograd, tiled_mlp.core.kernels.generic):
            patch.setattr(module, "capture_rng_state", counted)
        yield states


def real_step_states(monkeypatch, config: LlamaConfig, setting: Setting) -> LiveStates:
    model = build_model(config, None, torch.float32, "cpu", setting)
    ids = torch.randint(0, config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with states_counted(monkeypatch) as states:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
    paths = {layer.mlp.tiling.last_path for layer in model.model.layers}
    states.paths = paths  # type: ignore[attr-defined]
    return states


@pytest.mark.parametrize("setting", [TILED, TILED_CHECKPOINTED], ids=lambda s: s.name)
def test_the_generic_paths_generator_states_are_counted_as_host_memory_to_the_byte(monkeypatch, setting):
    monkeypatch.setattr(LlamaMLP, "forward", _gated_with_dropout)
    config = small_planner_llama(4)
    real = real_step_states(monkeypatch, config, setting)
    assert real.paths == {"generic"}  # type: ignore[attr-defined]
    assert real.live == 0 and real.peak >= 4 * setting.num_shards * 5056, (real.captured, real.peak)
    # Composed from the 2- and 3-layer steps, and the real full-depth step after every allocation, on the
    # device and on the host.
    planner, _, measured = predicted_to_the_byte(setting, config, SEQ)
    assert len(planner.stepped(setting)) == 2
    predicted = planner.timeline(setting, SEQ)
    assert predicted.host_peak() == measured.host_peak() == real.peak
    assert predicted.host_at_peak == {GENERATOR_STATES: real.peak}
    point = planner.point(setting, SEQ)
    assert point.host_parts == {GENERATOR_STATES: real.peak} and point.host_bytes == real.peak


def test_the_fast_path_saves_no_generator_state_and_none_is_counted(monkeypatch):
    config = small_planner_llama(3)
    real = real_step_states(monkeypatch, config, TILED)
    assert real.paths == {"fast"} and real.captured == 0  # type: ignore[attr-defined]
    planner, _, measured = predicted_to_the_byte(TILED, config, SEQ)
    assert measured.host == planner.timeline(TILED, SEQ).host == []
    assert planner.point(TILED, SEQ).host_parts == {}


def test_the_report_says_the_generator_states_are_counted():
    from tiled_mlp.planner.backends import Backend
    from tiled_mlp.planner.report import notes

    lines: List[str] = notes([], torch.bfloat16, Backend("single", 1), True)
    (line,) = [line for line in lines if "generator states" in line]
    assert "counted in 'host': the CPU generator states" in line and "not counted: library kernels' workspaces" in line
