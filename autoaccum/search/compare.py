"""The final comparison of a search: which finalist is fastest, and whether by more than the noise.

The finalists are measured in rounds; in each round every finalist runs once, back to back, the
order rotating (A B C, B C A, C A B, ...), so the readings of one round meet the same moment of a
machine whose load drifts. The statistic is paired. The *leader* has the best median reading; for
every other finalist the ratio of its reading to the leader's in the same round gives one ratio
per round, whose median (``ratio``) says how fast it is, and whose median absolute deviation says
how much one round strays (a round that met a busy moment moves one ratio, not the median). Its
``noise`` is the standard error of the median ratio, estimated robustly as
``1.2533 * 1.4826 * MAD / sqrt(rounds)`` (the median's standard error for normal scatter, the MAD
scaled to a standard deviation). A finalist is *within noise* of the leader when
``1 - ratio <= tolerance``: two standard errors, at least ``floor`` (a smaller gain is not worth a
more complex configuration) and at most ``ceiling`` (a finalist this much slower is never a tie).

Among the finalists within noise of the leader (the leader included) the simplest wins: fewer
knobs switched on, then fewer forward/backward passes per step (each pass has a fixed cost), then
the better median. Pure statistics on readings: nothing here runs a step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Finalist", "Verdict", "compare_finalists", "paired_ratios",
           "DEFAULT_TIE_FLOOR", "DEFAULT_TIE_CEILING", "NOISE_STANDARD_ERRORS"]

K = TypeVar("K", bound=Hashable)

#: a paired gap below this is a tie whatever the noise: not worth a more complex configuration
DEFAULT_TIE_FLOOR = 0.01
#: a paired gap above this is never a tie, however noisy the readings
DEFAULT_TIE_CEILING = 0.10
#: how many standard errors of the paired median ratio a gap must exceed to count
NOISE_STANDARD_ERRORS = 2.0
# the median's standard error for normal scatter is sqrt(pi / 2) * sigma / sqrt(n); a MAD of
# normal scatter is sigma / 1.4826
_MEDIAN_SE = math.sqrt(math.pi / 2) * 1.4826


@dataclass(frozen=True)
class Finalist(Generic[K]):
    """One finalist's readings against the leader's.

    Attributes:
        key: what the caller measured (e.g. a trial number).
        median: median of its readings (samples/s).
        ratio: median over rounds of its reading / the leader's in the same round (1.0 for the leader).
        spread: median absolute deviation of those per-round ratios (0.0 for the leader).
        noise: the standard error of ``ratio`` estimated from ``spread``.
        within_noise: its gap to the leader is within the tolerance.
        rounds: rounds in which both it and the leader were read.
    """

    key: K
    median: float
    ratio: float
    spread: float
    noise: float
    within_noise: bool
    rounds: int


@dataclass(frozen=True)
class Verdict(Generic[K]):
    """The comparison's outcome.

    Attributes:
        winner: the simplest finalist within noise of the leader.
        leader: the finalist with the best median.
        finalists: every finalist's numbers against the leader.
        tolerance_floor: the tolerance's lower bound used.
        tolerance_ceiling: the tolerance's upper bound used.
    """

    winner: K
    leader: K
    finalists: tuple[Finalist[K], ...]
    tolerance_floor: float
    tolerance_ceiling: float

    def of(self, key: K) -> Finalist[K]:
        return next(f for f in self.finalists if f.key == key)


def paired_ratios(readings: Sequence[float | None], reference: Sequence[float | None]) -> list[float]:
    """``readings[i] / reference[i]`` for every round ``i`` in which both were read (positive)."""
    return [a / b for a, b in zip(readings, reference) if a is not None and b is not None and a > 0 and b > 0]


def _tolerance(noise: float, floor: float, ceiling: float) -> float:
    return min(max(NOISE_STANDARD_ERRORS * noise, floor), ceiling)


def compare_finalists(readings: Mapping[K, Sequence[float | None]], simplicity: Callable[[K], tuple] | None = None,
                      *, floor: float = DEFAULT_TIE_FLOOR, ceiling: float = DEFAULT_TIE_CEILING) -> Verdict[K]:
    """The winner among finalists read in the same rounds (see the module docstring).

    Args:
        readings: per finalist, one reading per round (samples/s; higher is better), round ``i`` at
            index ``i`` for every finalist; ``None`` where a round has no reading.
        simplicity: a sort key, smaller is simpler (e.g. ``(knobs switched on, passes)``); without
            it the leader wins.
        floor: the tolerance's lower bound (a fraction of the leader's speed).
        ceiling: the tolerance's upper bound (a fraction of the leader's speed).

    Raises:
        ValueError: no finalist, a finalist without a reading, or bounds out of order.
    """
    if not readings:
        raise ValueError("compare_finalists needs at least one finalist")
    if not 0 <= floor <= ceiling < 1:
        raise ValueError(f"Invalid tolerance bounds: floor {floor}, ceiling {ceiling}. Allowed: 0 <= floor <= "
                         f"ceiling < 1")
    medians: dict[K, float] = {}
    for key, values in readings.items():
        read = [v for v in values if v is not None]
        if not read:
            raise ValueError(f"finalist {key!r} has no reading")
        medians[key] = statistics.median(read)
    leader = max(medians, key=lambda k: medians[k])
    finalists = []
    for key, values in readings.items():
        if key == leader:
            n = sum(v is not None for v in values)
            finalists.append(Finalist(key, medians[key], 1.0, 0.0, 0.0, True, n))
            continue
        ratios = paired_ratios(values, readings[leader])
        if not ratios:  # never read in the same round as the leader: no paired evidence of a tie
            finalists.append(Finalist(key, medians[key], medians[key] / medians[leader], math.inf, math.inf,
                                      False, 0))
            continue
        ratio = statistics.median(ratios)
        spread = statistics.median(abs(r - ratio) for r in ratios)
        noise = _MEDIAN_SE * spread / math.sqrt(len(ratios))
        finalists.append(Finalist(key, medians[key], ratio, spread, noise,
                                  1 - ratio <= _tolerance(noise, floor, ceiling), len(ratios)))
    tied = [f for f in finalists if f.within_noise]
    winner = leader if simplicity is None else min(tied, key=lambda f: (simplicity(f.key), -f.median)).key
    return Verdict(winner, leader, tuple(finalists), floor, ceiling)
