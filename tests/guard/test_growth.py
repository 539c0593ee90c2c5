"""The guard's growth back after an OOM (autoaccum.guard.growth and the policy), its thrash watch, and
the cheap recovery (autoaccum.memory.recovery).

The rules are arithmetic on plain values and are tested as such; the guard is then run for real
under an emulated budget (a TrackedMemory whose budget the test lowers and raises, as another
process taking memory and giving it back would): the exact sequence of micro-batches, the OOMs,
and every step against a hand-written full-batch step in fp64 (relative difference <= 1e-10).
Negative controls: blind doubling never returns after a transient squeeze; a guard that grows
without asking memory runs out of it; ranks that do not agree run different micro-batches.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _guard_models import Net, data, full_step, max_diff, mse, pair, params_of
from _spawn import results, spawn
from helpers import needs_gloo, rel_diff

import autoaccum.guard.policy as policy_module
import autoaccum.memory.recovery as recovery_module
from autoaccum import MemoryModel, OOMGuard, Plan, TrackedMemory
from autoaccum.distributed.sync import LocalSync
from autoaccum.guard.growth import FailedGrowth, Rise, fits, fitting_plan, memory_limit, predicted_rise
from autoaccum.memory import CudaMeter, MemoryReading, NullMeter

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

REL = 1e-10  # fp64: accumulated against full batch, relative to the reference's largest entry


def sgd_pair(hidden: int = 256):
    """A model and its twin, each with plain SGD + momentum (no per-step record: under the emulated
    budget every byte counts, and a record would grow the live bytes step by step)."""
    (model, _), (twin, _) = pair(Net(hidden=hidden))
    return ((model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)),
            (twin, torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)))


# -- the rules ----------------------------------------------------------------------------------------

def test_fitting_plan_takes_the_fewest_micro_steps_that_fit_up_to_the_largest():
    plan = Plan.for_target(1024, 128)  # 8 micro-steps
    asked = []

    def upto(limit):
        def fit(b):
            asked.append(b)
            return b <= limit
        return fit

    assert fitting_plan(plan, 256, upto(180)) == Plan.for_target(1024, 171)  # 6 x 171 (last 169)
    assert asked == [256, 205, 171]  # fewest steps first, each with the smallest micro-batch that makes it
    assert fitting_plan(plan, 256, upto(10_000)) == Plan.for_target(1024, 256)  # never above the largest
    assert fitting_plan(plan, 256, upto(140)) is None  # 147 (7 steps) does not fit: no step saved
    assert fitting_plan(Plan.for_target(1024, 256), 256, upto(10_000)) is None  # at the largest already
    two = Plan.for_target(1024, 64, world_size=2)  # 512 per rank in 8 micro-steps
    assert fitting_plan(two, 128, upto(110)) == Plan.for_target(1024, 103, world_size=2)
    with_min = Plan.for_target(10, 2, min_micro_batch=2)
    assert fitting_plan(with_min, 5, upto(4)) == Plan.for_target(10, 4, min_micro_batch=2)


def test_predicted_rise_from_the_line_the_probe_or_in_proportion():
    line = {64: Rise(64, 1000 + 64 * 10, 1000 + 64 * 10, 5000), 128: Rise(128, 1000 + 128 * 10, 2280, 9000)}
    assert predicted_rise(200, line) == 1000 + 200 * 10  # the line through the measured sizes
    assert predicted_rise(128, line) == 2280  # a measured size: its measurement
    # the optimizer step set the peak at 64 (it does not grow with b): predictions never go below it
    opt = {64: Rise(64, 1640, 3000, 5000), 128: Rise(128, 2280, 3000, 9000)}
    assert predicted_rise(100, opt) == 3000 and predicted_rise(400, opt) == 1000 + 400 * 10
    one = {64: Rise(64, 1640, 1700, 5000)}
    assert predicted_rise(32, one) is None  # nothing measured below, no line: no estimate
    assert predicted_rise(128, one) == 3400  # in proportion: an upper bound of 1000 + 10 b
    prior = MemoryModel(base_bytes=9e9, per_sample_bytes=12.0, opt_peak_bytes=0, residual=0.0, num_points=3)
    assert predicted_rise(128, one, prior) == 1640 + 12 * 64  # the probe's slope, anchored on the measurement
    # a growth to 128 failed after reaching 2800: a point on the line (2220 at 96), a floor at and above
    # 128, and between 64 and 128 the upper bound in proportion decides (2550), whatever the probe says
    failed = [FailedGrowth(128, free_bytes=2000, reached_bytes=2800)]
    assert predicted_rise(96, one, prior, failed) == 1700 * 96 // 64 > 1640 + (2800 - 1640) * 32 // 64
    assert predicted_rise(160, one, prior, failed) == 1700 * 160 // 64
    assert predicted_rise(160, one, prior, [FailedGrowth(128, 2000, reached_bytes=9000)]) == 1640 + 7360 * 96 // 64
    assert predicted_rise(100, {}, prior) is None


def test_fits_measured_sizes_by_their_room_others_with_headroom_and_not_a_failed_size_until_more_is_free():
    rises = {64: Rise(64, 1640, 1640, 2000), 128: Rise(128, 2280, 2280, 2400)}
    common = {"rises": rises, "headroom": 0.1}
    # 128 ran with 2,400 bytes free: with as much free it fits again, though 10% headroom would not allow it
    assert fits(128, live_bytes=1000, limit_bytes=3400, **common)
    assert 1000 + 2280 > 0.9 * 3400
    assert not fits(128, live_bytes=1001, limit_bytes=3400, **common)  # a byte less room: the model decides
    assert fits(128, live_bytes=1000, limit_bytes=3600, **common)  # 1000 + 2280 <= 0.9 x 3600
    assert fits(100, live_bytes=1000, limit_bytes=2400, **common) is False  # 1000 + 2000 > 2160
    assert fits(100, live_bytes=0, limit_bytes=2400, **common)
    failed = (FailedGrowth(100, free_bytes=3000, short_bytes=500),)
    assert not fits(100, live_bytes=0, limit_bytes=3500, failures=failed, **common)  # no more than 3,500 free
    assert not fits(128, live_bytes=0, limit_bytes=3500, failures=failed, **common)  # larger: blocked too
    assert fits(96, live_bytes=0, limit_bytes=3500, failures=failed, **common)  # smaller: not blocked
    assert fits(100, live_bytes=0, limit_bytes=3501, failures=failed, **common)  # more free than it lacked


def test_memory_limit_reads_the_emulated_budget_or_what_cuda_can_reach(monkeypatch):
    assert memory_limit(TrackedMemory(budget_bytes=4096)) == 4096
    assert memory_limit(TrackedMemory()) is None and memory_limit(NullMeter()) is None
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0, raising=False)
    assert memory_limit(CudaMeter("cuda:0")) == 16 * gib  # free + this process's cache
    assert memory_limit(CudaMeter("cuda:0", budget_bytes=12 * gib)) == 12 * gib  # a given budget caps it
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.1, raising=False)
    assert memory_limit(CudaMeter("cuda:0")) == 8 * gib  # the per-process fraction caps it


# -- the guard under an emulated budget ---------------------------------------------------------------

def _budgets(model, opt, target: int, micro: int) -> tuple[int, int]:
    """(bytes live between steps, the rise of a step at ``micro``) of a copy, measured by the guard itself."""
    (copy_model, copy_opt), _ = sgd_pair(model.fc1.out_features)
    copy_model.load_state_dict(model.state_dict())
    with TrackedMemory().track(copy_model, copy_opt) as mem:
        guard = OOMGuard(copy_model, copy_opt, target_batch=target, micro_batch=micro, meter=mem)
        rng = torch.get_rng_state()
        for s in range(2):  # the second step: the optimizer state exists
            result = guard.step(data(target, seed=100 + s), mse)
        torch.set_rng_state(rng)
        live = mem.current_bytes
    return live, result.peak_bytes - live


def squeezed_run(grow: str, *, squeeze: float, steps: int = 16, target: int = 1024, micro: int = 256,
                 **options: Any) -> tuple[OOMGuard, list[int], float]:
    """Train ``steps`` steps under a budget with room for ``micro``; steps 4-8 (five) get room for only
    ``squeeze`` of the rise. Returns the guard, the micro-batch of each step, and the relative
    difference to the full-batch reference after the last step."""
    (model, opt), (ref, ref_opt) = sgd_pair()
    live, rise = _budgets(model, opt, target, micro)
    full, tight = live + int(rise * 1.15), live + int(rise * squeeze)
    mem = TrackedMemory(budget_bytes=full).track(model, opt)
    kwargs = {"grow": grow, **options}
    with mem:
        guard = OOMGuard(model, opt, target_batch=target, micro_batch=micro, meter=mem, **kwargs)
        micros = []
        for s in range(steps):
            mem.budget_bytes = tight if 3 <= s < 8 else full
            micros.append(guard.step(data(target, seed=s), mse).plan.micro_batch)
    for s in range(steps):  # the reference, outside the budget
        full_step(ref, ref_opt, data(target, seed=s))
    return guard, micros, rel_diff(params_of(model), params_of(ref))


def test_after_a_transient_squeeze_it_grows_straight_back_and_stays_exact():
    guard, micros, diff = squeezed_run("auto", squeeze=0.6)  # the default, under a meter that knows the limit
    assert micros == [256] * 3 + [128] * 5 + [256] * 8  # back at the first step with the memory back
    assert [(c.step, c.reason, c.old.micro_batch, c.new.micro_batch) for c in guard.changes] == [
        (4, "oom", 256, 128), (9, "grow", 128, 256)]
    assert guard.changes[1].where == "predicted to fit in the free memory"
    assert guard.ooms == 1 and guard.failed_growths == 0
    assert diff <= REL


def test_halving_overshoots_and_the_model_grows_into_the_room_left_during_the_squeeze():
    guard, micros, diff = squeezed_run("auto", squeeze=0.8)
    # 256 fails, 128 runs; after two calm steps the model puts 171 (6 steps of 1,024) inside the room
    # (205 does not fit: blind doubling tries it below, and fails); then back to 256
    assert micros == [256] * 3 + [128] * 3 + [171] * 2 + [256] * 8
    assert guard.ooms == 1 and guard.failed_growths == 0 and diff <= REL


def test_negative_control_blind_doubling_never_returns_and_growth_off_stays_small():
    guard, micros, diff = squeezed_run("double", squeeze=0.8, grow_after=2)
    # 205 (double 128) is tried inside the squeeze and fails at once; 256 and 205 failed once: never tried
    # again, even with the memory back (the plan after each step: the growth follows the second calm step)
    assert micros == [256] * 3 + [128] * 2 + [205] + [128] * 2 + [171] * 8
    assert guard.ooms == 2 and diff <= REL
    guard, micros, diff = squeezed_run("off", squeeze=0.8)
    assert micros == [256] * 3 + [128] * 13 and guard.ooms == 1 and diff <= REL


def test_negative_control_growing_without_asking_memory_runs_out_of_it(monkeypatch):
    """The squeeze test can fail: a guard whose fitting rule says yes to everything grows into the
    squeeze after two calm steps and runs out of memory again; the failed growth is counted."""
    monkeypatch.setattr(policy_module, "fits", lambda b, **kwargs: True)
    guard, micros, diff = squeezed_run("auto", squeeze=0.6)
    assert guard.failed_growths == 1 and guard.ooms == 2 and diff <= REL  # the real rule: 0 and 1


def test_a_growth_that_runs_out_of_memory_backs_off_and_waits_for_more_room(caplog):
    """A probe model whose bytes per sample are far too low predicts that 256 fits again: the growth
    fails, is counted, the step is replayed at the size that worked (exactly), and 256 is not tried
    again while no more memory is free; the failed attempt's bytes correct the next prediction. With
    the budget raised, it grows to 256."""
    wrong = MemoryModel(base_bytes=0.0, per_sample_bytes=1.0, opt_peak_bytes=0, residual=0.0, num_points=2)
    (model, opt), (ref, ref_opt) = sgd_pair()
    live, rise = _budgets(model, opt, 1024, 256)
    tight, full = live + int(rise * 0.6), live + int(rise * 1.15)
    mem = TrackedMemory(budget_bytes=tight).track(model, opt)
    micros = []
    with mem, caplog.at_level(logging.WARNING, logger="autoaccum.guard"):
        guard = OOMGuard(model, opt, target_batch=1024, micro_batch=256, meter=mem, memory_model=wrong, headroom=0.0)
        for s in range(14):
            mem.budget_bytes = full if s >= 10 else tight
            result = guard.step(data(1024, seed=s), mse)
            micros.append((result.plan.micro_batch, result.attempts))
    for s in range(14):
        full_step(ref, ref_opt, data(1024, seed=s))
    # step 1: 256 fails -> 128 (nothing measured yet). Steps 2-3 calm at 128. Step 4: the wrong model says 256
    # fits: it fails, and the step is replayed at 128. It is not tried again while the room stays the same.
    assert micros[:4] == [(128, 2), (128, 1), (128, 1), (128, 2)]
    assert all(m == (128, 1) for m in micros[4:10]), micros
    assert micros[10:] == [(256, 1)] * 4  # more room: straight back
    assert guard.failed_growths == 1 and guard.ooms == 2
    assert [(c.step, c.reason, c.old.micro_batch, c.new.micro_batch) for c in guard.changes] == [
        (1, "oom", 256, 128), (4, "grow", 128, 256), (4, "oom", 256, 128), (11, "grow", 128, 256)]
    assert rel_diff(params_of(model), params_of(ref)) <= REL
    assert sum("OOM in" in r.message for r in caplog.records) == 2


def test_what_a_step_leaves_live_counts_in_the_next_start_not_in_its_rise():
    """AdamW creates its state in the first step: that step's peak is higher by the state, which every
    later step holds from its start. The rise recorded is that of a later step, from the first."""
    model = Net(hidden=4096)  # many parameters, few samples: the optimizer step sets the peak
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with TrackedMemory(budget_bytes=2**30).track(model, opt) as mem:
        guard = OOMGuard(model, opt, target_batch=4, micro_batch=4, meter=mem)
        starts, rises = [], []
        for s in range(3):
            batch = data(4, seed=s)
            starts.append(mem.current_bytes)  # the batch included, as in the guard's own reading
            result = guard.step(batch, mse)
            rises.append(result.peak_bytes - starts[-1])
            del batch
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    assert 0.9 * state < starts[1] - starts[0] <= state  # the moments (AdamW's step counters may sit elsewhere)
    assert rises[0] > rises[1] == rises[2]
    recorded = guard.policy.rises[4]
    # the later steps' rise (to a scalar or two of bookkeeping), not the first step's
    assert abs(recorded.step_bytes - rises[1]) <= 16 and recorded.step_bytes > recorded.fwd_bwd_bytes


def test_default_growth_needs_a_meter_that_knows_the_limit():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"grow='model' needs a meter that reads memory and knows its limit"):
        OOMGuard(model, opt, target_batch=64, micro_batch=8, grow="model")  # the CPU: no meter
    with pytest.raises(ValueError, match=r"grow='model' needs .*TrackedMemory"):
        OOMGuard(model, opt, target_batch=64, micro_batch=8, grow="model", meter=TrackedMemory())  # no budget
    with pytest.raises(ValueError, match=r"Invalid grow: 'grown'. Allowed values: auto, model, double, off"):
        OOMGuard(model, opt, target_batch=64, micro_batch=8, grow="grown")
    with pytest.raises(TypeError, match="memory_model must be an autoaccum.MemoryModel"):
        OOMGuard(model, opt, target_batch=64, micro_batch=8, memory_model={"base_bytes": 1})
    with pytest.raises(ValueError, match="headroom"):
        OOMGuard(model, opt, target_batch=64, micro_batch=8, headroom=1.5)
    OOMGuard(model, opt, target_batch=64, micro_batch=8, grow="model", meter=TrackedMemory(budget_bytes=2**30))


def test_the_probe_reports_model_and_headroom_reach_the_guard():
    from autoaccum.probe.report import ProbeReport

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mm = MemoryModel(base_bytes=10.0, per_sample_bytes=2.0, opt_peak_bytes=5, residual=0.0, num_points=3)
    report = ProbeReport(plan=Plan.for_target(64, 16), candidates=(), model=mm, device="cpu", device_name="cpu",
                         meter="tracked", is_estimate=False, budget_bytes=2**20, budget_source="given",
                         headroom=0.25, probe_steps=0, probe_ooms=0, wall_time_s=0.0, fit_note="")
    guard = OOMGuard(model, opt, plan=report)
    assert guard.policy.memory_model is mm and guard.policy.headroom == 0.25 and guard.plan == report.plan
    plain = OOMGuard(model, opt, plan=report.plan)
    assert plain.policy.memory_model is None and plain.policy.headroom == 0.1


# -- growth by doubling, none by default -----------------------------------------------------------

def changes_of(guard):
    return [(c.step, c.reason, c.where, c.old.micro_batch, c.new.micro_batch, c.new.accum_steps)
            for c in guard.changes]


def test_grow_after_calm_steps_never_tries_a_size_that_failed():
    """A device that holds 40 samples: 64 fails, and each growth is the smallest micro-batch that
    saves a micro-step, below every size that failed, back down to the last size that worked on
    an OOM. Throughout, every step is the exact full-batch step."""
    (model, opt), (ref, ref_opt) = pair(Net())
    model.trigger.cap = 40
    guard = OOMGuard(model, opt, target_batch=256, micro_batch=64, grow="double", grow_after=2)
    micros = []
    for s in range(14):
        batch = data(256, seed=s)
        full_step(ref, ref_opt, batch)
        micros.append(guard.step(batch, mse).plan.micro_batch)
    assert [(c.reason, c.old.micro_batch, c.new.micro_batch, c.new.accum_steps) for c in guard.changes] == [
        ("oom", 64, 32, 8), ("grow", 32, 52, 5),
        ("oom", 52, 32, 8), ("grow", 32, 43, 6),
        ("oom", 43, 32, 8), ("grow", 32, 37, 7),
    ]
    assert [c.step for c in guard.changes] == [1, 4, 4, 7, 7, 10]
    assert micros[-1] == 37 and guard.plan == Plan.for_target(256, 37)
    assert [size for size in model.trigger.sizes if size > 40] == [64, 52, 43]  # each failure once
    assert max_diff(params_of(model), params_of(ref)) < 1e-12


def test_no_growth_by_default():
    model = Net()
    model.trigger.arm("forward", 1)
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=64, micro_batch=64)
    for s in range(6):
        guard.step(data(64, seed=s), mse)
    assert changes_of(guard) == [(1, "oom", "forward/loss", 64, 32, 2)]


# -- the allocator thrashing -------------------------------------------------------------------------

class RetryMeter(NullMeter):
    """Counts no bytes, only CUDA's allocator retries (num_alloc_retries), set by the test before each
    step: a CPU cannot cause them."""

    kind = "counted"

    def __init__(self):
        self.retries = 0

    def read(self):
        return MemoryReading(0, 0, self.retries)


def thrash_run(guard, meter):
    """``step(retries, oom=False)``: one real step with the allocator's retries at ``retries`` (an OOM in
    its first attempt where asked), returning the step's thrash changes."""
    batch = data(64)
    oom = [False]

    def loss_fn(model, micro):
        if oom[0]:
            oom[0] = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (test)")
        return mse(model, micro)

    def step(retries, oom_first=False):
        meter.retries, oom[0] = retries, oom_first
        return [c for c in guard.step(batch, loss_fn).changes if c.reason == "thrash"]
    return step


def test_allocator_thrashing_on_consecutive_steps_shrinks_but_an_oom_step_does_not_count():
    """Retries rising on two clean steps in a row shrink the micro-batch; a step that replayed for an OOM
    retried by definition and does not count. Negative control: retries that do not rise never shrink."""
    model = Net()
    meter = RetryMeter()
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=64, micro_batch=32,
                     meter=meter, grow="off")
    step = thrash_run(guard, meter)
    assert step(0) == [] and step(0) == []
    assert step(1, oom_first=True) == [] and guard.plan.micro_batch == 16  # the OOM's own retry: the replay acted
    assert step(2) == []  # one step with retries is not thrashing yet
    (change,) = step(3)  # the second in a row is
    assert (change.reason, change.old.micro_batch, change.new.micro_batch) == ("thrash", 16, 8)
    assert step(3) == [] and step(4) == [] and guard.plan.micro_batch == 8
    calm_model = Net()
    calm = OOMGuard(calm_model, torch.optim.SGD(calm_model.parameters(), lr=0.1), target_batch=64, micro_batch=32,
                    meter=RetryMeter(), grow="off")
    calm_step = thrash_run(calm, calm.meter)
    assert [calm_step(5) for _ in range(4)] == [[]] * 4 and calm.plan.micro_batch == 32
    with pytest.raises(TypeError):
        OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=64, micro_batch=32,
                 thrash_steps=1.5)


def test_allocator_thrashing_on_one_of_several_ranks_is_said_first_and_shrunk_for_by_every_rank():
    """Across ranks a shrink is a collective (agree_plan) and a thrash streak is one rank's own: the
    streak issues no collective; it is said in the next step's exchange (the row's thrash field), and
    the step whose rows said it shrinks, on every rank alike (every rank reads the same rows). A step
    that replayed for an OOM shrank already: it does not shrink again. Negative control: the test
    above, in one process, shrinks on the streak itself. (Two real ranks:
    tests/distributed/test_distributed_faults.py.)"""

    class OneOfTwo(LocalSync):
        """Rank 1 of 2, the other rank's row a copy of this one's (its thrash field as the test says)."""
        world_size, rank = 2, 1

        def __init__(self):
            self.plans, self.rows, self.other_thrashes = [], [], False

        def gather(self, values):
            self.rows.append(values)
            other = values[:4] + (int(self.other_thrashes),)
            return (other, tuple(values))

        def agree_plan(self, plan):
            self.plans.append(plan.micro_batch)
            return plan

    model = Net()
    sync, meter = OneOfTwo(), RetryMeter()
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=128, micro_batch=16,
                     sync=sync, grow="off", meter=meter)
    step = thrash_run(guard, meter)
    assert [step(r) for r in (0, 2, 3)] == [[]] * 3  # the streak reached 2 in the third step: said, not acted on
    assert [row[4] for row in sync.rows] == [0, 0, 0] and sync.plans == [] and guard.plan.micro_batch == 16
    (change,) = step(3)  # the next step's exchange says it (this rank's row), and every rank shrinks after it
    assert sync.rows[-1][4] == 1 and (change.reason, change.old.micro_batch,
                                      change.new.micro_batch) == ("thrash", 16, 8)
    assert "rank 1" in change.describe() and sync.plans == [8]
    assert step(3) == [] and sync.rows[-1][4] == 0  # said and heard: a new streak from here
    sync.other_thrashes = True  # rank 0 says so in a step that replays for an OOM: no second shrink
    assert step(3, oom_first=True) == [] and guard.plan.micro_batch == 4 and sync.plans == [8, 4]
    (change,) = step(3)  # and in a clean one: every rank shrinks
    assert "rank 0" in change.describe() and guard.plan.micro_batch == 2


# -- recovery: what is collected ----------------------------------------------------------------------

def _oom_twice_in_one_step(monkeypatch, meter=None):
    collected = []
    monkeypatch.setattr(recovery_module.gc, "collect", lambda *args: collected.append(args) or 0)
    model = Net()
    model.trigger.cap = 20  # 64 and 32 fail, 16 fits: two OOMs in the first step
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=64, micro_batch=64,
                     meter=meter)
    guard.step(data(64), mse)
    assert guard.plan.micro_batch == 16 and guard.ooms == 2
    return collected


def test_without_a_meter_recovery_collects_the_young_generations_then_everything_on_a_second_oom(monkeypatch):
    assert _oom_twice_in_one_step(monkeypatch) == [(1,), ()]


def test_with_a_meter_that_shows_memory_back_nothing_is_collected(monkeypatch):
    with TrackedMemory() as mem:
        assert _oom_twice_in_one_step(monkeypatch, meter=mem) == []


def test_with_a_meter_that_shows_memory_missing_the_young_then_everything(monkeypatch):
    class Missing(NullMeter):
        kind = "test"

        def read(self):
            return MemoryReading(current_bytes=101, peak_bytes=0)  # a byte more than at the start, collected or not

    collected = []
    monkeypatch.setattr(recovery_module.gc, "collect", lambda *args: collected.append(args) or 0)
    assert recovery_module.release_memory(torch.device("cpu"), Missing(), start_bytes=100) == "full"
    assert collected == [(1,), ()]
    assert recovery_module.release_memory(torch.device("cpu"), Missing(), start_bytes=10_000) == "none"
    assert recovery_module.release_memory(torch.device("cpu")) == "full"  # no meter, by default: everything
    assert recovery_module.release_memory(torch.device("cpu"), thorough=False) == "young"


# -- rank agreement on two gloo ranks -----------------------------------------------------------------

class _NoAgreement:
    """A DistributedSync whose ranks keep their own plan (wrong on purpose: the negative control)."""

    def __init__(self, sync: Any) -> None:
        self._sync = sync

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sync, name)

    def agree_plan(self, plan: Plan) -> Plan:
        return plan


def two_ranks_squeezed(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank trains its share of 2 x 512 samples under its own emulated budget; at step 4 both
    budgets drop to room for about 40% of the 256-sample rise (two OOMs: 256 -> 128 -> 64); from step 7
    rank 0 gets its room back and rank 1 room for about 65% only (it proposes 171 or less, rank 0 256)."""
    from autoaccum.distributed import DistributedSync

    out: dict[str, Any] = {}
    for agree in (True, False):
        model, opt = sgd_pair()[0]
        live, rise = _budgets(model, opt, 512, 256)
        full = live + int(rise * 1.15)
        later = full if rank == 0 else live + int(rise * 0.65)
        mem = TrackedMemory(budget_bytes=full).track(model, opt)
        sync = DistributedSync(model)
        with mem:
            guard = OOMGuard(model, opt, target_batch=1024, micro_batch=256, meter=mem,
                             sync=sync if agree else _NoAgreement(sync))
            micros = []
            for s in range(10):
                mem.budget_bytes = full if s < 3 else live + int(rise * 0.4) if s < 6 else later
                batch = data(1024, seed=s)
                share = tuple(t[rank * 512:(rank + 1) * 512] for t in batch)
                micros.append(guard.step(share, mse).plan.micro_batch)
        out[agree] = {"micros": micros, "params": params_of(model), "ooms": guard.ooms,
                      "failed_growths": guard.failed_growths}
    return out


@needs_gloo
@pytest.mark.slow  # two spawned processes
def test_two_ranks_grow_to_the_smallest_size_any_rank_can_take(tmp_path: Path):
    codes, _ = spawn(two_ranks_squeezed, tmp_path)
    out = results(tmp_path, codes)
    (ref, ref_opt), _ = sgd_pair()
    for s in range(10):
        full_step(ref, ref_opt, data(1024, seed=s))
    agreed = [r[True] for r in out]
    assert agreed[0]["micros"] == agreed[1]["micros"]
    micros = agreed[0]["micros"]
    assert micros[:3] == [256] * 3 and micros[3:6] == [64] * 3
    assert 64 < micros[6] < 256 and micros[6:] == [micros[6]] * 4  # rank 1's room decides, rank 0 could take 256
    assert [r["ooms"] for r in agreed] == [2, 2] and [r["failed_growths"] for r in agreed] == [0, 0]
    for r in agreed:
        assert rel_diff(r["params"], params_of(ref)) <= REL
    # negative control: without the agreement the ranks run different micro-batches after the squeeze
    apart = [r[False]["micros"] for r in out]
    assert apart[0][6] == 256 and apart[1][6] == micros[6]
