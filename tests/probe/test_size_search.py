"""autoaccum.probe.size_search on memory that moves in allocator blocks: the fit keeps its slope, and the
search stops refining once the plan is settled (a real CUDA probe's readings, then a synthetic meter)."""

import pytest

from autoaccum.memory.model import MemoryModel, MemoryPoint
from autoaccum.plan.plan import Plan
from autoaccum.probe import size_search
from autoaccum.probe.report import Candidate
from autoaccum.probe.size_search import LIMIT_TOLERANCE, _next_size, fit_sizes, search_sizes

MIB = 2**20

# The 134M MLP (4096 -> 4096 x 8 -> 10) probed on an H200 under a 4 GiB budget (benchmarks/real_gpu.py at
# commit 7e4e770, --models mlp, 2026-11-26; that row has since left the benchmark): (micro-batch,
# forward/backward peak). The CUDA allocator rounds blocks to
# 2 MiB, so the peaks of 8773, 8783 and 8804 are the same bytes though ~160 KB a sample is real.
H200_MLP = [(1, 2284113408), (24, 2287881728), (192, 2315407872), (1536, 2585951744), (6364, 3470988800),
            (8467, 3809662976), (8697, 3848494592), (8804, 3869467136), (8783, 3869467136), (8773, 3869467136),
            (8735, 3853574144), (8754, 3856687104)]
H200_OPT_PEAK = 2754006016


def _candidates(rows):
    return [Candidate(b, "ok", max(p, H200_OPT_PEAK), p, H200_OPT_PEAK, None, None) for b, p in rows]


def test_a_fit_on_sizes_closer_than_the_allocator_rounding_takes_wider_points():
    model = fit_sizes(_candidates(H200_MLP), share=16384)
    slope = (3848494592 - 3470988800) / (8697 - 6364)  # two readings far apart: ~162 KB a sample
    assert model is not None and model.num_points > 3
    assert abs(model.per_sample_bytes - slope) <= 0.05 * slope, model
    # negative control: the three largest alone (what the fit took before) have no slope at all
    three = MemoryModel.fit([MemoryPoint(b, p, H200_OPT_PEAK) for b, p in sorted(H200_MLP)[-3:]])
    assert three.per_sample_bytes < 0.01 * slope


def test_three_sizes_already_spread_are_fitted_as_before():
    rows = [(100, 1000 + 10 * 100), (500, 1000 + 10 * 500), (900, 1000 + 10 * 900), (1000, 1000 + 10 * 1000)]
    model = fit_sizes(_candidates(rows), share=4096)
    assert model.num_points == 3 and model.per_sample_bytes == pytest.approx(10)


class BlockMemory:
    """The Stepper interface over synthetic memory: a pass at ``b`` peaks at ``base + per_sample x b``
    rounded up to ``block`` bytes (the CUDA allocator's rounding); every measured size is recorded."""

    def __init__(self, base, per_sample, block, usable, share):
        self.base, self.per_sample, self.block = base, per_sample, block
        self.usable_bytes, self.share, self.length = usable, share, None
        self.measured, self.batch_bytes, self.start_bytes, self.order = {}, {}, base, []

    @property
    def current(self):
        return {size: c for (size, _), c in self.measured.items()}

    def peak(self, b):
        return -(-(self.base + self.per_sample * b) // self.block) * self.block

    def limit(self):
        """The largest size whose peak is under the usable budget (the truth the search looks for)."""
        b = 1
        while self.peak(b + 1) <= self.usable_bytes:
            b += 1
        return b

    def measure(self, b):
        self.batch_bytes[(b, None)] = 0
        peak = self.peak(b)
        candidate = Candidate(b, "ok" if peak <= self.usable_bytes else "over_budget", peak, peak, self.base,
                              1e-3 * b, 1e-3 * b)
        self.measured[(b, None)] = candidate
        self.order.append(b)
        return candidate

    warm_up = measure


def _search(memory, budget):
    return search_sizes(memory, 1, memory.share, budget, 0.1, max_candidates=12)


def test_the_search_stops_once_the_plan_is_settled_within_the_tolerance(monkeypatch):
    budget = 4 * 2**30
    usable = int(budget * 0.9)
    # ~the H200 MLP: 2.2 GiB of weights, gradients and state; 160 KB a sample; 2 MiB blocks
    memory = BlockMemory(2_200_000_000, 160_000, 2 * MIB, usable, share=16384)
    _, note = _search(memory, budget)
    truth = memory.limit()
    found = max(b for b, c in memory.current.items() if c.status == "ok")
    assert truth * (1 - LIMIT_TOLERANCE) <= found <= truth, (found, truth, memory.order)
    assert Plan.for_target(16384, found).accum_steps == Plan.for_target(16384, truth).accum_steps
    assert "within 2%" in note, note
    # the same search refining to the last sample measures more sizes near the limit, where passes cost most
    monkeypatch.setattr(size_search, "LIMIT_TOLERANCE", 0.0)
    exact = BlockMemory(2_200_000_000, 160_000, 2 * MIB, usable, share=16384)
    _search(exact, budget)
    assert len(exact.order) > len(memory.order), (exact.order, memory.order)
    assert max(b for b, c in exact.current.items() if c.status == "ok") >= found


def test_the_search_refines_while_the_plan_could_still_change(monkeypatch):
    budget = 4 * 2**30
    usable = int(budget * 0.9)
    # the limit is 10406 samples; a share of 20808 takes 2 micro-batches at 10404 or more, 3 below: a
    # limit known to within 2% but not to the sample leaves the plan open
    memory = BlockMemory(2_200_000_000, 160_000, 2 * MIB, usable, share=20808)
    _search(memory, budget)
    found = max(b for b, c in memory.current.items() if c.status == "ok")
    assert memory.limit() == 10406
    assert Plan.for_target(20808, found).accum_steps == 2, (found, memory.order)
    # negative control: the tolerance alone, without asking whether the plan is the same, stops one pass
    # early with a plan of 3 micro-batches
    monkeypatch.setattr(size_search, "_same_plan", lambda lo, top, share: True)
    early = BlockMemory(2_200_000_000, 160_000, 2 * MIB, usable, share=20808)
    _search(early, budget)
    assert Plan.for_target(20808, max(b for b, c in early.current.items() if c.status == "ok")).accum_steps == 3


def test_a_limit_the_model_puts_a_little_short_does_not_cost_a_micro_batch(monkeypatch):
    """Found in review: the line through rounded peaks put the limit at 4297 where it is 4306; the plan
    was the same from 4295 to 4297 (10 micro-batches for 38,674 samples) but not at 4298 (9). The
    plan must be the same across the whole tolerance band above the largest size that fits."""
    budget = 4 * 2**30

    def search():
        memory = BlockMemory(3_176_037_801, 160_000, 2 * MIB, int(budget * 0.9), share=38674)
        search_sizes(memory, 2, 38674, budget, 0.1, max_candidates=12)
        return max(b for b, c in memory.current.items() if c.status == "ok")

    assert Plan.for_target(38674, search()).accum_steps == 9  # as refining to the last sample gives
    monkeypatch.setattr(size_search, "LIMIT_TOLERANCE", 0.0)
    assert Plan.for_target(38674, search()).accum_steps == 9
    monkeypatch.setattr(size_search, "LIMIT_TOLERANCE", 0.02)
    monkeypatch.setattr(size_search, "_same_plan", lambda lo, top, share: True)  # negative control
    assert Plan.for_target(38674, search()).accum_steps == 10


def _bracketed(share, upper=None, length=None, sizes=(1, 500, 1000, 1015)):
    """Memory whose limit is 1010 samples, measured at 1, 500, 1000 (fits) and 1015 (does not)."""
    budget = 10**7
    usable = int(budget * 0.9)
    memory = BlockMemory(usable - 1010 * 1000, 1000, 1, usable, share=share)
    for b in sizes:
        memory.measure(b)
    memory.length = length
    return _next_size(memory, upper or share, budget, 0.1)


def test_a_measured_bracket_within_the_tolerance_ends_the_search_only_if_the_plan_is_settled():
    size, note = _bracketed(share=4000)  # 4 micro-batches at any limit from 1000 to 1014
    assert size is None and "bracketed by measurement to within 2%" in note, note
    size, note = _bracketed(share=2014)  # 3 at 1000, 2 from 1007: the limit (1010) decides the plan
    assert size is not None and 1000 < size < 1015, (size, note)


def test_no_early_stop_on_an_unmeasured_bracket_or_at_one_length_of_variable_data():
    # max_micro_batch 1012 and nothing measured above 1000: the cap is no failure to bracket with (the
    # model may still end the search, having predicted the limit within the tolerance)
    size, note = _bracketed(share=4000, upper=1012, sizes=(1, 500, 1000))
    assert "by measurement" not in note, note
    assert size is not None or "limit predicted within 2% of 1000" in note, (size, note)
    # variable-length data plans from its token model: each length's limit is refined as before
    size, note = _bracketed(share=4000, length=128)
    assert size is not None and 1000 < size < 1015, (size, note)
