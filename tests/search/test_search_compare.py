"""autoaccum.search.compare: the final comparison's statistic on synthetic readings (no steps run)."""

from __future__ import annotations

import math
import statistics

import pytest

from autoaccum.search.compare import (
    DEFAULT_TIE_CEILING,
    DEFAULT_TIE_FLOOR,
    NOISE_STANDARD_ERRORS,
    compare_finalists,
    paired_ratios,
)

# finalists named by (knobs switched on, passes): the simplicity key is the name itself
SIMPLE = (0, 4)   # fp32, 4 passes
MORE = (0, 6)     # fp32, 6 passes
KNOB = (1, 2)     # bf16, 2 passes


def _key(k):
    return k


def test_a_clear_winner_wins_even_with_more_passes():
    # MORE is 20% faster in every round, the rounds' ratios barely stray: no tie
    readings = {SIMPLE: [100.0, 90.0, 110.0, 95.0, 105.0], MORE: [120.0, 108.0, 132.5, 114.0, 126.0]}
    verdict = compare_finalists(readings, _key)
    assert verdict.leader == MORE and verdict.winner == MORE
    simple = verdict.of(SIMPLE)
    assert simple.ratio == pytest.approx(1 / 1.2, rel=1e-3) and not simple.within_noise
    assert simple.rounds == 5 and simple.spread < 0.01


def test_a_tie_within_noise_goes_to_the_simplest():
    # KNOB leads by 3% in the median, but round by round the ratio swings by about 10%: no
    # evidence of a real gap; the tie goes to the configuration without knobs, then to fewer passes
    readings = {
        KNOB: [100.0, 100.0, 100.0, 100.0, 100.0],
        MORE: [104.0, 90.0, 96.0, 108.0, 97.0],
        SIMPLE: [110.0, 86.0, 97.0, 104.0, 92.0],
    }
    verdict = compare_finalists(readings, _key)
    assert verdict.leader == KNOB
    simple, more = verdict.of(SIMPLE), verdict.of(MORE)
    assert simple.ratio == pytest.approx(0.97) and simple.spread == pytest.approx(0.07)
    assert simple.noise == pytest.approx(math.sqrt(math.pi / 2) * 1.4826 * 0.07 / math.sqrt(5))
    assert simple.within_noise and more.within_noise
    assert verdict.winner == SIMPLE  # no knobs, and fewer passes than MORE
    # without a simplicity key, or with the spread gone, the leader keeps it
    assert compare_finalists(readings).winner == KNOB
    steady = {KNOB: [100.0] * 5, SIMPLE: [97.0] * 5}
    assert compare_finalists(steady, _key).winner == KNOB  # a steady 3% gap is real


def test_an_outlier_round_moves_one_ratio_not_the_verdict():
    # SIMPLE is 10% faster in four rounds; in one, a busy moment hit it alone (a 5x slower reading).
    # The paired median ignores it; a mean of the readings would not (negative control).
    readings = {SIMPLE: [110.0, 22.0, 110.0, 110.0, 110.0], MORE: [100.0] * 5}
    verdict = compare_finalists(readings, _key)
    assert verdict.leader == SIMPLE and verdict.winner == SIMPLE
    assert verdict.of(MORE).ratio == pytest.approx(1 / 1.1) and not verdict.of(MORE).within_noise
    assert statistics.mean(readings[SIMPLE]) < statistics.mean(readings[MORE])  # the mean would pick MORE
    # the same outlier on the leader's side: still one ratio out of five
    readings = {SIMPLE: [110.0] * 5, MORE: [100.0, 500.0, 100.0, 100.0, 100.0]}
    assert compare_finalists(readings, _key).winner == SIMPLE


def test_the_tolerance_is_bounded_by_floor_and_ceiling():
    # identical readings: the gap must still be within the floor to tie
    just_in = {SIMPLE: [100.0 * (1 - DEFAULT_TIE_FLOOR / 2)] * 3, MORE: [100.0] * 3}
    just_out = {SIMPLE: [100.0 * (1 - 2 * DEFAULT_TIE_FLOOR)] * 3, MORE: [100.0] * 3}
    assert compare_finalists(just_in, _key).winner == SIMPLE
    assert compare_finalists(just_out, _key).winner == MORE
    # wild readings (ratios swinging by 50%) cannot make a gap past the ceiling a tie
    wild = {MORE: [100.0] * 5, SIMPLE: [40.0, 150.0, 85.0, 60.0, 130.0]}
    gap = 1 - compare_finalists(wild, _key).of(SIMPLE).ratio
    assert gap > DEFAULT_TIE_CEILING and compare_finalists(wild, _key).of(SIMPLE).noise * NOISE_STANDARD_ERRORS > gap
    assert compare_finalists(wild, _key).winner == MORE


def test_rounds_without_a_reading_are_left_out_of_the_pairs():
    assert paired_ratios([1.0, None, 3.0, 4.0], [2.0, 2.0, None, 2.0]) == [0.5, 2.0]
    readings = {SIMPLE: [99.5, None, 99.5], MORE: [100.0, 100.0, 100.0]}
    verdict = compare_finalists(readings, _key)
    assert verdict.of(SIMPLE).rounds == 2 and verdict.winner == SIMPLE
    # never read in the same round as the leader: no evidence of a tie
    apart = {SIMPLE: [99.9, None], MORE: [None, 100.0]}
    assert not compare_finalists(apart, _key).of(SIMPLE).within_noise


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least one finalist"):
        compare_finalists({})
    with pytest.raises(ValueError, match="has no reading"):
        compare_finalists({SIMPLE: [None, None], MORE: [1.0, 2.0]})
    with pytest.raises(ValueError, match="Invalid tolerance bounds: floor 0.2, ceiling 0.1"):
        compare_finalists({SIMPLE: [1.0]}, floor=0.2, ceiling=0.1)
