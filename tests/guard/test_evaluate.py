"""The guarded evaluation of a hand loop (``OOMGuard.evaluate``, autoaccum.guard.evaluate): nanoGPT's
``estimate_loss`` under an emulated budget used to die of an OOM the guard did not cover.

References: the full batch in one forward, in eval mode, without gradients. fp64 agrees to rel 1e-12. The
micro-batches tried are asserted exactly. Negative controls: the mean of the micro-batch means over an uneven cut,
and a forward in training mode (dropout on), differ from the reference.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _guard_models import (
    Net,
    RecordingSGD,
    TokenModel,
    data,
    mse,
    params_of,
    sizes_for,
    token_batch,
    token_mean,
    token_sum,
)
from _spawn import results, spawn
from helpers import InjectedOOM, needs_gloo

from autoaccum import DoesNotFitError, OOMGuard

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

N = 50  # not the training batch: an evaluation batch of any size, cut 13 + 13 + 12 + 12 at micro-batch 16


def guard_of(model, micro=16, target=64, **kwargs):
    return OOMGuard(model, RecordingSGD(model.parameters(), lr=0.1), target_batch=target, micro_batch=micro, **kwargs)


def full_eval(model, batch, loss_fn=mse):
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        return float(loss_fn(ref, batch))


def test_evaluate_equals_the_full_batch_loss_after_an_injected_oom(caplog):
    model = Net(p=0.2)
    guard = guard_of(model)
    batch = data(N, seed=3)
    want = full_eval(model, batch)
    before = params_of(model)
    model.trigger.arm("forward", 2)
    with caplog.at_level(logging.WARNING, logger="autoaccum.guard"):
        got = guard.evaluate(batch, mse)
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert model.trigger.sizes == [13, 13] + sizes_for(N, 6)  # the failed pass, then 6 x 5 + 5 x 4
    assert [r.getMessage() for r in caplog.records] == \
        ["OOM in evaluation: eval micro-batch 13 -> 6 (the training plan is unchanged)"]
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), before))
    assert guard.plan.micro_batch == 16 and guard.changes == [] and guard.ooms == 0 and guard.steps == 0
    model.trigger.sizes = []
    assert guard.evaluate(batch, mse) == pytest.approx(want, rel=1e-12, abs=0)
    assert model.trigger.sizes == sizes_for(N, 6)  # the next evaluation starts where this one ended
    guard.step(data(64), mse)  # and training keeps its own plan
    assert model.trigger.sizes[-4:] == [16] * 4


def test_negative_control_a_mean_of_means_or_a_training_mode_forward_differs():
    model = Net(p=0.2)
    batch = data(N, seed=3)
    want = full_eval(model, batch)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        parts = torch.split(batch[0], [13, 13, 12, 12]), torch.split(batch[1], [13, 13, 12, 12])
        mean_of_means = float(torch.stack([mse(ref, (x, y)) for x, y in zip(*parts)]).mean())
        trained = copy.deepcopy(model).train()
        train_mode = float(mse(trained, batch))
    assert abs(mean_of_means - want) > 1e-6 * abs(want)
    assert abs(train_mode - want) > 1e-3 * abs(want)


def test_a_token_level_evaluation_equals_the_full_batch_token_mean_after_an_oom():
    model = TokenModel()
    guard = OOMGuard(model, RecordingSGD(model.parameters(), lr=0.1), target_batch=32, micro_batch=8)
    batch = token_batch(24)
    calls = []

    def loss_fn(m, b):
        calls.append(b["labels"].shape[0])
        if len(calls) == 3:
            raise InjectedOOM("injected")
        return token_sum(m, b)

    got = guard.evaluate(batch, loss_fn)
    assert got == pytest.approx(full_eval(model, batch, token_mean), rel=1e-12, abs=0)
    assert calls == [8, 8, 8] + [4] * 6


def test_evaluate_under_the_guards_budget_shrinks_where_the_plans_micro_batch_does_not_fit():
    """The nanoGPT case: the evaluation forward runs on the emulated device of budget=, whose OOM it recovers."""
    def eval_peak(micro):
        model = Net(hidden=256)
        guard = guard_of(model, micro, target=128, budget="1GiB")
        guard.meter.reset_peak()
        guard.evaluate(data(128, seed=5), mse)
        return guard.meter.peak_bytes

    small, big = eval_peak(32), eval_peak(64)
    assert small < big
    model = Net(hidden=256)
    guard = guard_of(model, 64, target=128, budget=(small + big) // 2)
    batch = data(128, seed=5)
    assert guard.evaluate(batch, mse) == pytest.approx(full_eval(model, batch), rel=1e-12, abs=0)
    assert guard.meter.oom_count == 1 and guard.meter.peak_bytes <= (small + big) // 2
    assert model.trigger.sizes == [32] * 4  # 64 ran out before the probe point; then 32 x 4


def test_evaluate_at_one_sample_that_does_not_fit_raises_and_puts_the_mode_back():
    model = Net()
    guard = guard_of(model, 2)
    model.trigger.cap = 0  # no micro-batch fits
    with pytest.raises(DoesNotFitError, match="a micro-batch of 1 does not fit"):
        guard.evaluate(data(4), mse)
    assert model.trigger.sizes == [2, 1] and model.training


def test_evaluate_refuses_swapped_arguments():
    model = Net()
    guard = guard_of(model)
    with pytest.raises(TypeError, match=r"OOMGuard.evaluate\(batch, loss_fn\) got a function as batch"):
        guard.evaluate(lambda m, b: F.mse_loss(m(b[0]), b[1]), data(8))


def two_ranks_evaluate(rank: int, world_size: int) -> dict:
    """Rank 0 evaluates 26 samples (13 + 13 at micro-batch 16), rank 1 24 (12 + 12); rank 1's second forward runs
    out of memory, and both ranks evaluate again at half the largest micro-batch any rank ran (13 -> 6)."""
    from autoaccum.distributed import DistributedSync

    model = Net(p=0.2)
    guard = OOMGuard(model, RecordingSGD(model.parameters(), lr=0.1), target_batch=64, micro_batch=16,
                     sync=DistributedSync(model))
    share = tuple(t[:26] if rank == 0 else t[26:] for t in data(N, seed=3))
    if rank == 1:
        model.trigger.arm("forward", 2)
    return {"loss": guard.evaluate(share, mse), "sizes": model.trigger.sizes}


@needs_gloo
@pytest.mark.slow  # two spawned processes
def test_two_ranks_agree_on_the_evaluation_shrink_and_return_the_full_batch_loss(tmp_path: Path):
    out = results(tmp_path, spawn(two_ranks_evaluate, tmp_path)[0])
    want = full_eval(Net(p=0.2), data(N, seed=3))
    assert [r["loss"] for r in out] == [out[0]["loss"]] * 2  # the same value on every rank
    assert out[0]["loss"] == pytest.approx(want, rel=1e-12, abs=0)
    # the same number of micro-steps on every rank (5; rank 1's last one empty), at the same micro-batch
    assert out[0]["sizes"] == [13, 13, 6, 5, 5, 5, 5] and out[1]["sizes"] == [12, 12, 6, 6, 6, 6]
