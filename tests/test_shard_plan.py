"""The shard plan: every token in exactly one shard, in order, sizes within one of each other."""
from __future__ import annotations

import pytest

from tiled_mlp.core.shard_plan import check_num_shards, make_shard_plan, split_evenly

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 10, 64, 101])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7, 64, 200])
def test_plan_covers_every_token_once(num_tokens, num_shards):
    plan = make_shard_plan(num_tokens, num_shards)
    covered = [t for s in plan.slices() for t in range(num_tokens)[s]]
    assert covered == list(range(num_tokens))
    assert plan.num_shards == min(num_shards, num_tokens)
    assert all(size >= 1 for size in plan.shard_sizes)
    assert max(plan.shard_sizes) - min(plan.shard_sizes) <= 1
    assert plan.slice_tuple[0].start == 0 and sum(plan.shard_sizes) == num_tokens


def test_uneven_split_puts_the_extra_tokens_first():
    assert split_evenly(10, 3) == (4, 3, 3)
    assert split_evenly(2, 5) == (1, 1)
    assert split_evenly(0, 3) == (0,)  # one empty shard: the kernel still runs once


def test_auto_must_be_resolved_before_planning():
    with pytest.raises(ValueError, match="resolve num_shards='auto'"):
        make_shard_plan(100, "auto")


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), ("four", ValueError), ("", ValueError),
                                        (True, TypeError), (False, TypeError), (2.0, TypeError), (None, TypeError)])
def test_bad_num_shards_is_rejected_with_a_message(bad, error):
    with pytest.raises(error, match="num_shards"):
        check_num_shards(bad)
    with pytest.raises(error, match="num_shards"):
        make_shard_plan(10, bad)
