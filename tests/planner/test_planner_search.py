"""The search for the longest fitting length (``tiled_mlp/planner/search.py``) on made-up totals: its
answer is certified (fits, and one step longer does not), it stops at the cap and says so, and the
guesses keep the number of modelled steps small on the near-affine totals a step has."""
from __future__ import annotations

import math

import pytest

from tiled_mlp.planner.search import longest_fitting

STEP = 1024


def counted(total):
    calls = []

    def held(seq):
        calls.append(seq)
        return total(seq)

    return held, calls


@pytest.mark.parametrize("budget", [10.5, 100.0, 777.7, 5000.0])
@pytest.mark.parametrize("shape", ["affine", "convex", "concave", "flat then steep"])
def test_the_answer_is_the_longest_and_certified(shape, budget):
    total = {
        "affine": lambda s: 10 + 0.01 * s,
        "convex": lambda s: 10 + (s / 4096) ** 2,
        "concave": lambda s: 10 + 30 * math.sqrt(s / 1024),
        "flat then steep": lambda s: 10 if s < 65536 else 10 + (s - 65536) * 0.5,
    }[shape]
    held, calls = counted(total)
    found = longest_fitting(held, budget, STEP, 2**22)
    grid = [k * STEP for k in range(1, 2**22 // STEP + 1)]
    expected = max((s for s in grid if total(s) <= budget), default=0)
    assert found.seq == expected and found.at_cap == (expected == grid[-1])
    if expected and not found.at_cap:
        assert expected in calls and expected + STEP in calls, "the answer is backed by two modelled steps"
    assert len(calls) == len(set(calls)), "no length is modelled twice"
    assert len(calls) <= 2 * 22 + 2, calls


def test_a_near_affine_total_needs_few_steps_beyond_the_known_ones():
    held, calls = counted(lambda s: 30e9 + 2.1e6 * s)
    known = {seq: 30e9 + 2.1e6 * seq for seq in (8192, 32768, 65536, 131072)}
    found = longest_fitting(held, 80 * 2**30, STEP, 2**20, known)
    assert found.seq == max(s for s in range(STEP, 2**20, STEP) if 30e9 + 2.1e6 * s <= 80 * 2**30)
    assert len(calls) <= 3, calls


def test_nothing_fits():
    held, calls = counted(lambda s: 100.0)
    found = longest_fitting(held, 50.0, STEP, 2**20)
    assert found.seq == 0 and not found.at_cap and calls == [STEP]


def test_the_cap_is_reached_and_said_so():
    held, calls = counted(lambda s: 1.0 + s * 1e-9)
    found = longest_fitting(held, 50.0, STEP, 2**20)
    assert found.seq == 2**20 and found.at_cap
    assert len(calls) <= 3, calls


def test_known_points_off_the_grid_are_not_used_as_answers():
    held, calls = counted(lambda s: s)
    found = longest_fitting(held, 5000, STEP, 2**16, known={5000: 5000, 4999: 4999})
    assert found.seq == 4096 and 4096 in calls and 5120 in calls
