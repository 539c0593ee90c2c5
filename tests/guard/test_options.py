"""The guard's options (autoaccum.guard.options): ``budget=`` (an emulated device off CUDA, refused on CUDA) and
``scheduler=`` (refused where the guard could not step it).

The budget is measured, not written in: the peaks of a guarded step at micro-batch 64 and 32 on an emulated device
too large to matter, and a budget halfway between them. The hand loop under it is compared with a full-batch step
in fp64 (max |diff| < 1e-12, the weights are O(0.1)); controls: the budget really bites (a plain step at 64 under it
raises torch.OutOfMemoryError, a guard without budget= never shrinks), and the comparison tells a wrongly weighted
accumulation from the exact one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _guard_models import Net, data, full_step, manual_step, max_diff, mse, params_of, sizes_for

import autoaccum.guard.guard as guard_module
from autoaccum import OOMGuard, Plan, TrackedMemory, emulated_budget

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

TARGET = 128


def sgd_pair(hidden: int = 256):
    """A model and its twin, each with plain SGD + momentum (no per-step record: on an emulated device every byte
    counts, and a record would grow the live bytes step by step)."""
    model = Net(hidden=hidden)
    twin = copy.deepcopy(model)
    return ((model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)),
            (twin, torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)))


def step_peak(micro: int) -> int:
    """The largest step peak of a guarded hand loop at ``micro`` on an emulated device that never runs out."""
    (model, opt), _ = sgd_pair()
    guard = OOMGuard(model, opt, target_batch=TARGET, micro_batch=micro, budget="1GiB")
    return max(guard.step(data(TARGET, seed=s), mse).peak_bytes for s in range(3))


@pytest.fixture(scope="module")
def budget() -> int:
    """Bytes between the peaks of micro-batch 32 and 64: 64 does not fit, 32 does."""
    small, big = step_peak(32), step_peak(64)
    assert small < big, (small, big)
    return (small + big) // 2


def test_budget_runs_a_hand_loop_on_an_emulated_device_that_shrinks_and_equals_the_full_batch(budget):
    (model, opt), (ref, ref_opt) = sgd_pair()
    guard = OOMGuard(model, opt, target_batch=TARGET, micro_batch=64, budget=budget)
    assert guard.meter is guard.emulated and isinstance(guard.meter, TrackedMemory)
    assert guard.meter.budget_bytes == budget
    results = []
    for s in range(4):
        batch = data(TARGET, seed=s)
        results.append(guard.step(batch, mse))
        full_step(ref, ref_opt, batch)
    assert max_diff(params_of(model), params_of(ref)) < 1e-12
    assert [(c.step, c.reason, c.old.micro_batch, c.new.micro_batch, c.new.accum_steps) for c in guard.changes] == \
        [(1, "oom", 64, 32, 4)]  # the first micro-batch did not fit; no growth back to it
    assert [r.attempts for r in results] == [2, 1, 1, 1]
    assert guard.meter.oom_count == 1 and guard.meter.last_oom_needed_bytes > budget
    assert all(r.peak_bytes <= budget for r in results[1:])
    assert model.trigger.sizes[-4 * 4:] == [32] * 16


def test_negative_control_the_budget_bites_and_the_comparison_tells_a_wrong_accumulation(budget):
    """Without the guard a step at 64 under that budget raises a real torch.OutOfMemoryError; a guard without
    budget= never shrinks; an accumulation at 32 that sums the micro-batch means differs from the full batch."""
    (model, opt), (ref, ref_opt) = sgd_pair()
    with pytest.raises(torch.OutOfMemoryError, match="emulated by autoaccum"):
        with emulated_budget(budget, model, opt):
            manual_step(model, opt, data(TARGET, seed=0), sizes_for(TARGET, 64))
    free = OOMGuard(ref, ref_opt, target_batch=TARGET, micro_batch=64)
    free.step(data(TARGET, seed=0), mse)
    assert free.changes == [] and free.plan.micro_batch == 64
    (model, opt), (ref, ref_opt) = sgd_pair()
    batch = data(TARGET, seed=0)
    manual_step(model, opt, batch, sizes_for(TARGET, 32), weighting="sum")
    full_step(ref, ref_opt, batch)
    assert max_diff(params_of(model), params_of(ref)) > 1e-6


def test_budget_is_refused_where_it_would_mean_nothing_or_be_a_second_budget(monkeypatch):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="meter= would be another"):
        OOMGuard(model, opt, target_batch=64, micro_batch=32, budget="64MiB", meter=TrackedMemory())
    with pytest.raises(ValueError, match="64Mb"):
        OOMGuard(model, opt, target_batch=64, micro_batch=32, budget="64Mb")  # bits, not bytes
    with emulated_budget("1GiB", model, opt):
        with pytest.raises(TypeError, match="two budgets"):
            OOMGuard(model, opt, target_batch=64, micro_batch=32, budget="64MiB")
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=32, budget="64MiB")
    with emulated_budget("1GiB", model, opt):  # entered after the guard was built: refused at the step
        with pytest.raises(TypeError, match="two budgets"):
            guard.step(data(64), mse)
    assert opt.state == {}  # nothing stepped
    # on CUDA the guard runs no probe, so budget= would plan nothing: refused, with plan= as with micro_batch=
    monkeypatch.setattr(guard_module.OOMGuard, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(TypeError, match=r"budget='64MiB' would mean nothing on cuda.*target_batch= and micro_batch="):
        OOMGuard(model, opt, target_batch=64, micro_batch=32, budget="64MiB")
    with pytest.raises(TypeError, match=r"would mean nothing on cuda.*plan=\).*autoaccum.probe"):
        OOMGuard(model, opt, plan=Plan.for_target(64, 32), budget="64MiB")


def test_a_scheduler_the_guard_cannot_step_is_refused_at_construction():
    """It used to fail after optimizer.step() had run: a half-done step."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"scheduler='cosine' has no step\(\) method; expected a "
                                        r"torch.optim.lr_scheduler.LRScheduler .* or an object with step\(\)"):
        OOMGuard(model, opt, target_batch=64, micro_batch=32, scheduler="cosine")
    with pytest.raises(TypeError, match=r"scheduler=a dict has no step\(\)"):
        OOMGuard(model, opt, target_batch=64, micro_batch=32, scheduler={"name": "cosine"})
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(TypeError, match=r"scheduler=a ReduceLROnPlateau: its step\(.*metrics.*needs an argument.*"
                                        r"scheduler.step\(val_loss\)"):
        OOMGuard(model, opt, target_batch=64, micro_batch=32, scheduler=plateau)
    # control: a torch scheduler and an object of one's own with step() are taken, and stepped once a step
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    OOMGuard(model, opt, target_batch=64, micro_batch=32, scheduler=cosine).step(data(64), mse)
    assert cosine.last_epoch == 1

    class Mine:
        steps = 0

        def step(self, epoch=None):
            self.steps += 1

    mine = Mine()
    OOMGuard(model, opt, target_batch=64, micro_batch=32, scheduler=mine).step(data(64), mse)
    assert mine.steps == 1


def test_a_per_epoch_scheduler_is_told_it_counts_optimizer_steps():
    """A StepLR(step_size=epochs) passed as scheduler= decayed at every optimizer step, silently (documented, not
    said where it was passed): warned, naming step_size. Control: a per-step schedule (LambdaLR) is not."""
    import warnings

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"StepLR\(step_size=3\) is stepped once per optimizer step, not once per "
                                         r"epoch.*counts optimizer steps"):
        OOMGuard(model, optimizer, target_batch=8, micro_batch=4,
                 scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OOMGuard(model, optimizer, target_batch=8, micro_batch=4,
                 scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
