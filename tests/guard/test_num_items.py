"""The ``(loss_sum, num_items)`` protocol watched (autoaccum.plan.task.ItemWatch, and the count check of
autoaccum.step.accumulate): ``@guard.wrap`` returning ``(loss, 5)`` used to divide the loss by 5 per micro-batch,
silently.

The rule: counts that add up to a fraction or below 0 are certainly not counts (TaskError before the optimizer
step); a Python int that stays the same while the micro-batch changes (within a step, or after a shrink) is
likely not one (one warning). Controls: real counts -- a Python int that grows with the micro-batch, a token count
that varies, a tensor -- are not warned about, and the guard's result equals the full-batch token mean.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _guard_models import Net, RecordingSGD, TokenModel, data, params_of, token_batch, token_mean, token_sum

from autoaccum import OOMGuard
from autoaccum.errors import TaskError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

LIKELY = r"num_items=5 for micro-batches of 6 and 7 samples.*likely not a count"


def guard_of(model, micro, **kwargs):
    return OOMGuard(model, RecordingSGD(model.parameters(), lr=0.1), target_batch=64, micro_batch=micro, **kwargs)


def test_wrap_returning_a_constant_int_over_an_uneven_cut_is_warned_about_once():
    model = Net()
    guard = guard_of(model, 7)  # 64 = 7 x 4 + 6 x 6

    @guard.wrap
    def train_step(batch):
        x, y = batch
        return F.mse_loss(model(x), y), 5  # (loss, something): read as (loss_sum, num_items)

    with pytest.warns(UserWarning, match=LIKELY) as caught:
        for s in range(3):
            train_step(data(64, seed=s))
    assert len([w for w in caught if "num_items" in str(w.message)]) == 1


def test_a_constant_int_is_warned_about_when_a_shrink_changes_the_micro_batch():
    """Micro-batches of one size all along give nothing to compare; the replay after an OOM does (16 -> 8)."""
    model = Net()
    guard = guard_of(model, 16)

    def loss_fn(m, batch):
        return F.mse_loss(m(batch[0]), batch[1]), 5

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.step(data(64, seed=0), loss_fn)  # 16 x 4: nothing to tell yet
    model.trigger.arm("forward", 2)
    with pytest.warns(UserWarning, match=r"num_items=5 for micro-batches of 8 and 16 samples"):
        guard.step(data(64, seed=1), loss_fn)
    assert guard.plan.micro_batch == 8


def test_fractional_or_negative_counts_are_a_task_error_before_the_optimizer_step():
    """Read where the step's total is read (one wait for the device, there anyway): a metric in the count's place
    (an accuracy of 0.3 per micro-batch), a negative count, a NaN."""
    for count in (torch.tensor(0.3), torch.tensor(-3), torch.tensor(float("nan"))):
        model = Net()
        before = params_of(model)
        guard = guard_of(model, 16)
        with pytest.raises(TaskError, match=r"num_items add up to .*not a count of items \(a whole number >= 0\)"):
            guard.step(data(64), lambda m, b, count=count: (F.mse_loss(m(b[0]), b[1], reduction="sum"), count))
        assert guard.optimizer.calls == 0 and all(torch.equal(a, b) for a, b in zip(params_of(model), before))


@pytest.mark.parametrize("count", ["numel", "tokens-int", "tokens-tensor"])
def test_negative_control_real_counts_are_not_warned_about_and_equal_the_full_batch(count):
    """A Python int that grows with the micro-batch (fixed-length rows), a token count that varies, a tensor:
    no warning; the step equals the full-batch token mean (fp64)."""
    if count == "numel":
        model = Net()
        guard = guard_of(model, 7)

        def loss_fn(m, b):
            return F.mse_loss(m(b[0]), b[1], reduction="sum"), b[1].numel()  # a Python int: rows x 3

        batch = data(64)
        ref_model = Net()
        want = F.mse_loss(ref_model(batch[0]), batch[1])
    else:
        model = TokenModel()
        guard = OOMGuard(model, RecordingSGD(model.parameters(), lr=0.1), target_batch=32, micro_batch=7)

        def loss_fn(m, b):
            total, items = token_sum(m, b)
            return total, int(items) if count == "tokens-int" else items

        batch = token_batch(32)
        want = token_mean(TokenModel(), batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = guard.step(batch, loss_fn)
    assert result.loss == pytest.approx(float(want.detach()), rel=1e-12, abs=0)
