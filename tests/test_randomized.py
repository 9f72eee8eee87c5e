"""Randomised shapes (hypothesis): batch, tokens, hidden, intermediate, shards, bias, path, layout,
activation, input grad on/off. Each example checks output, input grad and every weight grad
against the untiled float64 reference."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import (
    ACTS,
    FusedGatedMLP,
    GatedMLP,
    PlainMLP,
    assert_runs_close,
    fresh_inputs,
    seeded,
    tiled_run,
    untiled_run,
)

LAYOUTS = {"separate": GatedMLP, "fused": FusedGatedMLP}

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    batch = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 17))
    return dict(
        batch=batch,
        tokens=tokens,
        hidden=draw(st.integers(1, 12)),
        intermediate=draw(st.integers(1, 20)),
        num_shards=draw(st.integers(1, batch * tokens + 2)),
        bias=draw(st.booleans()),
        path=draw(st.sampled_from(["auto", "fast", "generic"])),
        layout=draw(st.sampled_from(sorted(LAYOUTS))),
        act=draw(st.sampled_from(ACTS)),
        input_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.timeout(120)
@SETTINGS
@given(case=cases())
def test_gated_random_shapes(case):
    mlp = seeded(LAYOUTS[case["layout"]], case["seed"], case["hidden"], case["intermediate"], case["act"], bias=case["bias"])
    x, dy = fresh_inputs((case["batch"], case["tokens"], case["hidden"]), case["hidden"], seed=case["seed"] + 1,
                         requires_grad=case["input_grad"])
    got, tiled = tiled_run(mlp, x, dy, num_shards=case["num_shards"], path=case["path"])
    assert tiled.tiling.last_path == ("generic" if case["path"] == "generic" else "fast")
    assert_runs_close(untiled_run(mlp, x, dy), got, context=str(case))


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None, derandomize=True)
@given(batch=st.integers(1, 3), tokens=st.integers(1, 13), hidden=st.integers(1, 9), intermediate=st.integers(1, 16),
       shards=st.integers(1, 16), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_non_gated_random_shapes(batch, tokens, hidden, intermediate, shards, bias, seed):
    mlp = seeded(PlainMLP, seed, hidden, intermediate, bias=bias)
    x, dy = fresh_inputs((batch, tokens, hidden), hidden, seed=seed + 1)
    got, tiled = tiled_run(mlp, x, dy, num_shards=shards)
    assert tiled.tiling.last_path == "generic"
    assert_runs_close(untiled_run(mlp, x, dy), got)
