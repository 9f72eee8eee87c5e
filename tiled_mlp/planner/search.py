"""The longest sequence whose step fits a budget: a search on a grid of lengths whose answer is
certified by the step itself, whatever guided the guesses.

The answer ``k`` grid steps comes with two modelled points, ``k`` fitting and ``k + 1`` not (or
``k`` at the cap); with a held total that never falls as the length grows (checked for every preset,
``tests/planner/test_planner_depth.py``) that is the longest. The guesses only decide how many full-depth
steps are modelled: a step's total is close to affine in the length (activations and logits grow
with it, weights do not), so the line through the two nearest modelled points (regula falsi) usually
lands next to the answer, and two or three steps beyond the table's suffice. Where the curve bends
away from the line, the guards below fall back to doubling and to bisection, so the search never
takes more than about twice bisection's count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional


@dataclass(frozen=True)
class Longest:
    seq: int  # the longest fitting multiple of the grid step; 0: not even one step
    at_cap: bool  # the cap itself fits: the search stopped there, and the answer is "at least seq"


def longest_fitting(held: Callable[[int], float], budget: float, step: int, cap: int,
                    known: Optional[Dict[int, float]] = None) -> Longest:
    """``held(seq)``: the total the budget judges at ``seq`` tokens (the planner passes a load, the
    fuller of device and host as a share of their budgets, against a budget of 1.0); it must not fall
    as the length grows. ``known``: totals modelled already (the table's), used as guides where they
    lie on the grid."""
    top = cap // step
    totals: Dict[int, float] = {seq // step: v for seq, v in (known or {}).items()
                                if seq % step == 0 and 0 < seq <= cap}

    def fits(k: int) -> bool:
        if k not in totals:
            totals[k] = held(k * step)
        return totals[k] <= budget

    # A known fitting length implies the shortest fits (the total grows with the length).
    if not any(v <= budget for v in totals.values()) and not fits(1):
        return Longest(0, False)
    low = max(k for k in totals if totals[k] <= budget)
    high: Optional[int] = min((k for k in totals if k > low and totals[k] > budget), default=None)
    sides: List[bool] = []  # whether each guess since the bracket closed fitted
    while high is None:
        below = max((k for k in totals if k < low), default=None)
        guess = 2 * low if below is None else _crossing(below, totals[below], low, totals[low], budget)
        if len(sides) >= 2 and sides[-1] and sides[-2]:  # the line keeps falling short: at least double
            guess = max(guess, 2 * low)
        guess = min(top, max(low + 1, guess))
        sides.append(fits(guess))
        if not sides[-1]:
            high = guess
        elif guess == top:
            return Longest(top * step, True)
        else:
            low = guess
    sides = []
    while high - low > 1:
        guess = _crossing(low, totals[low], high, totals[high], budget)
        if len(sides) >= 2 and sides[-1] == sides[-2]:  # the line keeps landing on one side: bisect
            guess = (low + high) // 2
        guess = min(high - 1, max(low + 1, guess))
        sides.append(fits(guess))
        if sides[-1]:
            low = guess
        else:
            high = guess
    return Longest(low * step, False)


def _crossing(k0: int, v0: float, k1: int, v1: float, budget: float) -> int:
    """The grid point at or below where the line through (k0, v0) and (k1, v1) meets the budget."""
    if v1 <= v0:  # flat: no crossing in sight
        return k1 + (k1 - k0)
    return int(k0 + (budget - v0) * (k1 - k0) / (v1 - v0))
