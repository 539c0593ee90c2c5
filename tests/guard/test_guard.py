"""The OOM guard (autoaccum.guard): exact accumulation, step boundaries, and OOM replay.

References are hand-written (tests/_guard_models.py): a full-batch step, or a plain accumulation
loop that planned the smaller micro-batch. fp64 agrees to 1e-12, fp32 to rtol 1e-5. Every rule
has a negative control: the wrong way of doing it, shown to differ from the reference.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from _guard_models import (
    Net,
    RecordingSGD,
    TokenModel,
    data,
    full_step,
    manual_step,
    max_diff,
    mse,
    pair,
    params_of,
    phase_peaks,
    sizes_for,
    token_batch,
    token_mean,
    token_sum,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autoaccum.guard.guard as guard_module
import autoaccum.memory.recovery as recovery_module
import autoaccum.step.accumulate as accumulate_module
from autoaccum import DoesNotFitError, OOMGuard, OptimizerStepOOMError, Plan, emulated_budget
from autoaccum.errors import NonFiniteError, TaskError

TOL = {torch.float64: {"rtol": 0.0, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
WHERE = {"forward": "forward/loss", "loss": "forward/loss", "backward": "backward"}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def assert_close(a, b, dtype=torch.float64):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **TOL[dtype])


def changes_of(guard):
    return [(c.step, c.reason, c.where, c.old.micro_batch, c.new.micro_batch, c.new.accum_steps)
            for c in guard.changes]


# -- exact accumulation ---------------------------------------------------------------------------

@DTYPES
@pytest.mark.parametrize("micro", [64, 32, 16, 8, 1, 7], ids=lambda m: f"micro{m}")
def test_accumulated_equals_full_batch(dtype, micro):
    (model, opt), (ref, ref_opt) = pair(Net(dtype=dtype))
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=micro)
    for s in range(3):
        batch = data(64, dtype=dtype, seed=s)
        full_loss, _ = full_step(ref, ref_opt, batch)
        result = guard.step(batch, mse)
        assert result.loss == pytest.approx(full_loss, rel=1e-12 if dtype == torch.float64 else 1e-5)
        assert (result.num_samples, result.num_items, result.attempts, result.skipped) == (64, None, 1, False)
    for got, want in zip(opt.grads, ref_opt.grads):
        assert_close(got, want, dtype)
    assert_close(params_of(model), params_of(ref), dtype)
    assert model.trigger.sizes == sizes_for(64, micro) * 3  # the exact micro-batches run
    assert guard.plan == Plan.for_target(64, micro) and guard.changes == [] and guard.steps == 3


@pytest.mark.parametrize("weighting, micro", [("sum", 8), ("mean", 7)])
def test_negative_control_unweighted_micro_losses_differ_from_full_batch(weighting, micro):
    """The naive loop (sum of micro means), or a mean of means over an uneven split, is not the
    full-batch gradient; the same loop with share weighting is."""
    batch = data(64)
    (model, opt), (ref, ref_opt) = pair(Net())
    exact = copy.deepcopy(model)
    exact_opt = RecordingSGD(exact.parameters(), lr=0.1, momentum=0.9)
    manual_step(model, opt, batch, sizes_for(64, micro), weighting=weighting)
    manual_step(exact, exact_opt, batch, sizes_for(64, micro), weighting="share")
    full_step(ref, ref_opt, batch)
    assert max_diff(opt.grads[0], ref_opt.grads[0]) > 1e-3
    assert max_diff(exact_opt.grads[0], ref_opt.grads[0]) < 1e-12


def _token_reference(model, opt, batch, loss=token_mean, **kw):
    opt.zero_grad(set_to_none=True)
    value = loss(model, batch, **kw)
    value.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(value.detach())


@pytest.mark.parametrize("counts", ["tensor", "int"])
@pytest.mark.parametrize("micro", [32, 8, 5, 1])
def test_token_level_loss_equals_the_full_batch_token_mean(micro, counts):
    (model, opt), (ref, ref_opt) = pair(TokenModel())
    guard = OOMGuard(model, opt, target_batch=32, micro_batch=micro)

    def loss_fn(m, b):
        loss, count = token_sum(m, b)
        return loss, (count if counts == "tensor" else int(count))

    for s in range(3):
        batch = token_batch(seed=s)
        want = _token_reference(ref, ref_opt, batch)
        result = guard.step(batch, loss_fn)
        assert result.loss == pytest.approx(want, rel=1e-12)
        assert result.num_items == int((batch["labels"] != -100).sum())
    for got, ref_grads in zip(opt.grads, ref_opt.grads):
        assert_close(got, ref_grads)
    assert_close(params_of(model), params_of(ref))


def test_negative_control_mean_of_token_means_differs_from_token_mean():
    (model, opt), (ref, ref_opt) = pair(TokenModel())
    guard = OOMGuard(model, opt, target_batch=32, micro_batch=8)
    batch = token_batch()
    want = _token_reference(ref, ref_opt, batch)
    result = guard.step(batch, token_mean)  # each micro-batch's own token mean, weighted by samples
    assert abs(result.loss - want) > 1e-3
    assert max_diff(opt.grads[0], ref_opt.grads[0]) > 1e-3


def test_every_micro_batch_runs_under_the_autocast_it_asks_for(monkeypatch):
    """accumulate makes its autocast context once and enters it for each micro-batch in turn: every
    forward and loss runs under it, and it is off again afterwards. Negative control: a context that
    casts only the first time it is entered (what a context that cannot be re-entered would leave) is
    caught by the same check."""
    from autoaccum.plan.cut import MicroBatch

    model = nn.Linear(4, 2)
    seen: list[tuple[bool, torch.dtype]] = []

    def loss_fn(m, batch):
        out = m(batch)
        seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
        return out.float().pow(2).mean()

    def run() -> list[tuple[bool, torch.dtype]]:
        seen.clear()
        micro = [MicroBatch(torch.randn(3, 4), 3) for _ in range(4)]
        result = accumulate_module.accumulate(model, micro, loss_fn, num_samples=12, device=torch.device("cpu"),
                                              autocast_dtype=torch.bfloat16)
        assert isinstance(result, accumulate_module.Accumulated)
        assert not torch.is_autocast_enabled("cpu")
        return list(seen)

    assert run() == [(True, torch.bfloat16)] * 4

    class FirstTimeOnly:
        def __init__(self, device, dtype):
            self.inner, self.entered = torch.autocast(device.type, dtype=dtype), 0

        def __enter__(self):
            self.entered += 1
            return self.inner.__enter__() if self.entered == 1 else None

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc) if self.entered == 1 else None

    monkeypatch.setattr(accumulate_module, "autocast", FirstTimeOnly)
    assert run() == [(True, torch.bfloat16)] + [(False, torch.float32)] * 3


@pytest.mark.parametrize("kind", ["mean", "sum", "normalized"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_loss_sum_is_a_float64_sum_with_one_rounding_per_micro_batch(kind, dtype):
    """accumulate adds the weighted losses up in float64 (``add_(loss, alpha=size)`` per micro-batch, one
    rounding each), for every kind of loss and dtype, with an uneven last micro-batch. Negative controls,
    what a plausible wrong sum gives instead: for a float64 mean loss ``sum += loss * size`` on the host
    (two roundings), for other float64 losses a float32 sum, else a sum in the loss's own dtype."""
    from autoaccum.plan.cut import MicroBatch

    g = torch.Generator().manual_seed(9)  # a seed whose float64 sums tell one rounding from two
    sizes = [7] * 12 + [3]
    values = (torch.rand(len(sizes), generator=g, dtype=torch.float64) * 10).to(dtype)  # full precision
    model = nn.Linear(4, 2).to(dtype)
    given = iter(values)

    def loss_fn(m, batch, **kwargs):
        loss = m(batch).sum() * 0 + next(given)  # requires grad; the value is ours
        return (loss, 5) if kind == "sum" else loss

    micro = [MicroBatch(torch.randn(n, 4, generator=g, dtype=dtype), n) for n in sizes]
    result = accumulate_module.accumulate(model, micro, loss_fn, num_samples=sum(sizes), device=torch.device("cpu"),
                                          num_items_in_batch=20 if kind == "normalized" else None)
    assert isinstance(result, accumulate_module.Accumulated)
    weights = [n if kind == "mean" else 1 for n in sizes]
    device_sum = torch.zeros((), dtype=torch.float64)
    for value, w in zip(values, weights):
        device_sum.add_(value, alpha=w)
    assert float(result.loss_sum) == device_sum.item()
    if dtype == torch.float64 and kind == "mean":
        wrong = 0.0
        for value, w in zip(values.tolist(), weights):
            wrong += value * w
    else:
        wrong_sum = torch.zeros((), dtype=torch.float32 if dtype == torch.float64 else dtype)
        for value, w in zip(values, weights):
            wrong_sum.add_(value.to(wrong_sum.dtype), alpha=w)
        wrong = wrong_sum.item()
    assert float(result.loss_sum) != wrong, "the wrong sum is the same here: the check cannot tell"


def test_token_level_divides_optimizer_parameters_outside_the_model():
    """A parameter the loss owns (a temperature) is stepped by the optimizer: its gradient is
    normalised by the step's token count like the model's."""
    model, ref = TokenModel(), TokenModel()
    temp, ref_temp = (nn.Parameter(torch.tensor(0.7, dtype=torch.float64)) for _ in range(2))
    opt = RecordingSGD([*model.parameters(), temp], lr=0.1)
    ref_opt = RecordingSGD([*ref.parameters(), ref_temp], lr=0.1)
    guard = OOMGuard(model, opt, target_batch=32, micro_batch=8)
    for s in range(2):
        batch = token_batch(seed=s)
        _token_reference(ref, ref_opt, batch, scale=ref_temp)
        guard.step(batch, lambda m, b: token_sum(m, b, scale=temp))
    for got, want in zip(opt.grads, ref_opt.grads):
        assert_close(got, want)
    assert_close([temp.detach()], [ref_temp.detach()])


def test_mixing_mean_and_token_sum_losses_in_one_step_is_a_task_error():
    model = TokenModel()
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=32, micro_batch=8)
    calls = [0]

    def loss_fn(m, b):
        calls[0] += 1
        return token_sum(m, b) if calls[0] == 2 else token_mean(m, b)

    with pytest.raises(TaskError, match="same kind"):
        guard.step(token_batch(), loss_fn)
    assert calls[0] == 2 and guard.changes == []


# -- step boundaries: clipping, scheduler, scaler ---------------------------------------------------

@DTYPES
def test_clipping_once_equals_full_batch_clipping(dtype):
    max_norm = 0.05
    (model, opt), (ref, ref_opt) = pair(Net(dtype=dtype))
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=8, max_grad_norm=max_norm)
    for s in range(3):
        batch = data(64, dtype=dtype, seed=s)
        _, norm = full_step(ref, ref_opt, batch, max_grad_norm=max_norm)
        assert norm > 4 * max_norm  # clipping is active
        result = guard.step(batch, mse)
        assert result.grad_norm == pytest.approx(norm, rel=1e-12 if dtype == torch.float64 else 1e-5)
    for got, want in zip(opt.grads, ref_opt.grads):  # gradients as the optimizer saw them: clipped
        assert_close(got, want, dtype)
    assert_close(params_of(model), params_of(ref), dtype)


def test_negative_control_clipping_each_micro_batch_differs():
    (model, opt), (ref, ref_opt) = pair(Net())
    batch = data(64)
    manual_step(model, opt, batch, sizes_for(64, 8), max_grad_norm=0.05, clip_each=True)
    full_step(ref, ref_opt, batch, max_grad_norm=0.05)
    assert max_diff(opt.grads[0], ref_opt.grads[0]) > 1e-4


def test_parameters_outside_the_optimizer_carry_no_gradient_into_the_next_step():
    """fc1 trains no further (not in the optimizer) but still has requires_grad: its gradient
    counts in the clipping norm of each step, and only that step's, replay included."""
    (model, _), (ref, _) = pair(Net(p=0.0))
    opt = RecordingSGD(model.fc2.parameters(), lr=0.1, momentum=0.9)
    ref_opt = RecordingSGD(ref.fc2.parameters(), lr=0.1, momentum=0.9)
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=16, max_grad_norm=0.05)
    for s in range(3):
        if s == 1:
            model.trigger.arm("backward", at=3)  # partial gradients of the failed attempt
        batch = data(64, seed=s)
        _, norm = full_step(ref, ref_opt, batch, max_grad_norm=0.05)
        assert guard.step(batch, mse).grad_norm == pytest.approx(norm, rel=1e-12)
    assert_close(params_of(model), params_of(ref))


@pytest.mark.parametrize("call", ["step", "accumulate"])
def test_gradients_set_before_a_step_are_cleared_first(call):
    """Gradients a user left on the parameters (in the optimizer or not) before step() or accumulate()
    are cleared first: the step's gradients are the global batch's alone, as in the full-batch
    reference. Negative control: the same stale gradients left in a hand-written accumulation change them."""
    (model, _), (ref, ref_opt) = pair(Net(p=0.0))
    opt = RecordingSGD(model.fc2.parameters(), lr=0.1, momentum=0.9)  # fc1 is outside the optimizer
    ref_opt = RecordingSGD(ref.fc2.parameters(), lr=0.1, momentum=0.9)
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=16)
    for s in range(3):
        batch = data(64, seed=s)
        for p in model.parameters():
            p.grad = torch.full_like(p, 7.0)  # stale: must not reach the step
        full_step(ref, ref_opt, batch)
        if call == "step":
            guard.step(batch, mse)
        else:
            guard.accumulate(batch, mse)
            assert_close([p.grad for p in model.fc2.parameters()], ref_opt.grads[-1])
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.fc1.weight.grad = model.fc1.bias.grad = None
    assert_close(params_of(model), params_of(ref))
    stale = copy.deepcopy(ref)
    for p in stale.parameters():
        p.grad = torch.full_like(p, 7.0)
    mse(stale, data(64, seed=3)).backward()  # a loop that forgot to clear first
    fresh = copy.deepcopy(ref)
    mse(fresh, data(64, seed=3)).backward()
    assert max_diff([p.grad for p in stale.parameters()], [p.grad for p in fresh.parameters()]) > 1.0



def _count_calls(obj, name):
    """Wrap ``obj.name`` so that its calls are counted: returns the count, a one-element list."""
    calls = [0]
    inner = getattr(obj, name)

    def counting(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    setattr(obj, name, counting)
    return calls


def test_step_leaves_no_gradient_behind_and_opens_with_one_zero_grad():
    """After step() no parameter holds a gradient: the model's (in the optimizer or not) and those of a
    param group added to the optimizer after the guard was built; optimizer.zero_grad is called once
    a step, at its start (the end clears directly). Negative control: clearing only the parameters the
    guard knew when it was built leaves the added group's gradient behind."""
    model = Net(p=0.0)
    opt = RecordingSGD(model.fc2.parameters(), lr=0.1)  # fc1 is outside the optimizer
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=16)
    scale = nn.Parameter(torch.ones(()))
    opt.add_param_group({"params": [scale]})  # e.g. a layer unfrozen after the guard was built
    calls = _count_calls(opt, "zero_grad")

    def loss_fn(m, batch):
        return mse(m, batch) * scale

    for s in range(2):
        guard.step(data(64, seed=s), loss_fn)
        assert calls[0] == s + 1
        assert all(p.grad is None for p in [*model.parameters(), scale])
    (loss_fn(model, data(64, seed=2))).backward()
    for p in guard.params:  # the negative control: what the guard knew when it was built
        p.grad = None
    assert scale.grad is not None


def test_scheduler_steps_once_per_optimizer_step_never_per_micro_batch():
    model = Net()
    opt = RecordingSGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    calls = _count_calls(sched, "step")
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=8, scheduler=sched)
    lrs = []
    for s in range(3):
        if s == 1:
            model.trigger.arm("backward", at=5)  # a replay must not step the scheduler again
        lrs.append(guard.step(data(64, seed=s), mse).lr)
    assert (calls[0], sched.last_epoch, opt.calls) == (3, 3, 3)
    assert lrs == [0.1, 0.05, 0.025]  # the learning rate each step used
    assert opt.param_groups[0]["lr"] == 0.0125


def _counting_unscale(scaler):
    calls = [0]
    unscale = scaler.unscale_

    def counting(optimizer):
        calls[0] += 1
        return unscale(optimizer)

    scaler.unscale_ = counting
    return calls


def test_grad_scaler_unscales_once_per_step_before_clipping():
    dtype = torch.float32
    (model, opt), (ref, ref_opt) = pair(Net(dtype=dtype))
    scaler = torch.amp.GradScaler("cpu")
    calls = _counting_unscale(scaler)
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=16, scaler=scaler, max_grad_norm=0.05)
    for s in range(3):
        if s == 1:
            model.trigger.arm("backward", at=3)  # replayed with the scaler's state reset
        batch = data(64, dtype=dtype, seed=s)
        _, norm = full_step(ref, ref_opt, batch, max_grad_norm=0.05)
        result = guard.step(batch, mse)
        assert not result.skipped and result.grad_norm == pytest.approx(norm, rel=1e-5)
    assert calls[0] == 3
    assert scaler.get_scale() == 65536.0
    assert_close(params_of(model), params_of(ref), dtype)


def test_grad_scaler_skip_leaves_parameters_optimizer_and_scheduler_untouched():
    model = Net(dtype=torch.float32)
    opt = RecordingSGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=16, scaler=scaler, scheduler=sched, max_grad_norm=1.0)
    factor = [1.0]

    def loss_fn(m, b):
        return mse(m, b) * factor[0]

    first = guard.step(data(64, dtype=torch.float32, seed=0), loss_fn)
    params, state = params_of(model), copy.deepcopy(opt.state_dict())
    factor[0] = float("inf")  # inf/NaN gradients on this step only
    skipped = guard.step(data(64, dtype=torch.float32, seed=1), loss_fn)
    assert not first.skipped and skipped.skipped
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params))
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.05
    torch.testing.assert_close(opt.state_dict(), state, rtol=0, atol=0)
    assert scaler.get_scale() == 2.0**9
    factor[0] = 1.0
    after = guard.step(data(64, dtype=torch.float32, seed=2), loss_fn)
    assert not after.skipped and sched.last_epoch == 2 and max_diff(params_of(model), params) > 0


class _NanGrad(torch.autograd.Function):
    """Identity forward; backward returns NaN: finite loss, NaN gradients (the case a loss check misses)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("poison", ["loss", "grad", "inf-grad"])
def test_nonfinite_gradients_never_reach_the_weights(clip, poison):
    """fp32, no scaler: a NaN/inf loss or a NaN gradient under a finite loss is found after accumulation and
    before optimizer.step(). 'stop' raises with the weights, optimizer state and scheduler of the step before
    and the gradients cleared; 'skip' does the same without raising (skipped=True); None steps as before
    (the negative control: the weights then hold NaN)."""
    def make(policy):
        model = Net(dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        guard = OOMGuard(model, opt, target_batch=64, micro_batch=16, scheduler=sched, max_grad_norm=clip,
                         nonfinite=policy)
        return model, opt, sched, guard

    bad = [False]

    def loss_fn(m, b):
        loss = mse(m, b)
        if bad[0] and poison == "grad":  # the loss stays finite (+ 0); every parameter's gradient is NaN
            loss = loss + 0 * _NanGrad.apply(m(b[0])).sum()
            assert torch.isfinite(loss)
        if bad[0] and poison == "loss":
            return loss * float("nan")
        if bad[0] and poison == "inf-grad":
            return loss * torch.tensor(float("inf"))  # inf loss, inf * 0 gradients: NaN
        return loss

    for policy in ("stop", "skip", None):
        model, opt, sched, guard = make(policy)
        bad[0] = False
        guard.step(data(64, dtype=torch.float32, seed=0), loss_fn)
        params, state = params_of(model), copy.deepcopy(opt.state_dict())
        bad[0] = True
        if policy == "stop":
            with pytest.raises(NonFiniteError, match="of optimizer step 2; stopped before optimizer.step") as info:
                guard.step(data(64, dtype=torch.float32, seed=1), loss_fn)
            assert info.value.step == 2 and guard.steps == 1
        else:
            result = guard.step(data(64, dtype=torch.float32, seed=1), loss_fn)
            assert result.skipped == (policy == "skip")
        if policy is None:  # no check: the step ran and wrote NaN (what happened before the check existed)
            assert any(not torch.isfinite(p).all() for p in model.parameters())
            continue
        assert all(torch.equal(a, b) for a, b in zip(params_of(model), params))
        torch.testing.assert_close(opt.state_dict(), state, rtol=0, atol=0)
        assert sched.last_epoch == 1 and all(p.grad is None for p in model.parameters())
        bad[0] = False  # and the run goes on from there
        after = guard.step(data(64, dtype=torch.float32, seed=2), loss_fn)
        assert not after.skipped and sched.last_epoch == 2 and max_diff(params_of(model), params) > 0


def test_the_check_folded_into_clipping_clips_as_before():
    """With clipping, the check is the total norm clipping computes: the result equals clip_grad_norm_."""
    dtype = torch.float64
    (model, opt), (ref, ref_opt) = pair(Net(dtype=dtype))
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=16, max_grad_norm=0.05)
    for s in range(3):
        batch = data(64, dtype=dtype, seed=s)
        _, norm = full_step(ref, ref_opt, batch, max_grad_norm=0.05)
        result = guard.step(batch, mse)
        assert result.grad_norm == pytest.approx(norm, rel=1e-12) and norm > 0.05  # clipped
    assert_close(params_of(model), params_of(ref), dtype)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_norm_that_overflows_is_not_taken_for_an_inf_gradient(clip):
    """The check reduces gradients to 2-norms, which overflow for large finite values (fp16 past 65504,
    fp32 past ~1.8e19): only an inf or NaN element counts, a large norm does not."""
    from autoaccum.step.optim import _check_finite

    def params(value, dtype):
        p = nn.Parameter(torch.zeros(100, dtype=dtype))
        p.grad = torch.full((100,), value, dtype=dtype)
        return [p, nn.Parameter(torch.zeros(3))]

    assert torch.isinf(torch.full((100,), 1e4, dtype=torch.float16).norm())  # the overflow it guards against
    assert _check_finite(params(1e4, torch.float16), None, clip, None)[0]
    assert _check_finite(params(1e30, torch.float32), torch.tensor(2.0), clip, None)[0]
    for bad in (float("inf"), float("nan")):
        assert not _check_finite(params(bad, torch.float32), None, clip, None)[0]
        assert not _check_finite(params(1.0, torch.float32), torch.tensor(bad), clip, None)[0]
        assert not _check_finite(params(1.0, torch.float32), bad, clip, None)[0]


class _HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value on the host (``item()``, ``float()``, ``bool()``) while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.on, self.reads = False, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("clip", [None, 1.0])
def test_nothing_is_read_from_the_device_after_the_optimizer_step_is_launched(monkeypatch, clip):
    """The check's one read carries the loss (and, clipping, the norm): after ``optimizer.step()`` nothing
    waits for the device, so the next step's host work overlaps the optimizer (on CUDA; a hand-written
    loop's one read is its loss). ``tolist`` is counted too: it reads without an aten op on the CPU. The
    result still holds the full batch's loss and the norm."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = OOMGuard(model, opt, target_batch=32, micro_batch=8, max_grad_norm=clip)
    reads = _HostReads()
    stepped, tolist = opt.step, torch.Tensor.tolist

    def step(*args, **kwargs):
        out = stepped(*args, **kwargs)
        reads.on = True  # from here to the end of guard.step()
        return out

    def counted_tolist(self):
        reads.reads += reads.on
        return tolist(self)

    monkeypatch.setattr(opt, "step", step)
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    batch = data(32)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        expected = mse(ref, batch).item()
    with reads:
        result = guard.step(batch, mse)
    assert reads.reads == 0
    assert result.loss == pytest.approx(expected, rel=1e-12) and isinstance(result.loss, float)
    assert (result.grad_norm is None) == (clip is None)
    # the negative control: a loss read after the step is seen
    with reads:
        reads.on = True
        float(torch.tensor(1.0) + 1)
    assert reads.reads == 1


def test_buffer_copies_are_made_again_into_the_same_tensors():
    """The guard's buffer snapshot: the same tensors every step, holding the buffers' values at the
    capture; a buffer replaced by a restore (a shape change) gets a copy of its own, not itself."""
    from autoaccum.state import BufferCopies, restore_buffers, state_buffers

    model = Net(batchnorm=True)
    copies = BufferCopies(state_buffers(model))
    first = copies.capture()
    assert [n for _, n, _ in first] == ["running_mean", "running_var", "num_batches_tracked"]
    model(data(16)[0])  # updates the running statistics
    second = copies.capture()
    assert all(a is b for (_, _, a), (_, _, b) in zip(first, second))
    assert all(torch.equal(saved, getattr(m, n)) and saved is not getattr(m, n) for m, n, saved in second)
    model(data(16)[0])
    restore_buffers(second)
    assert all(torch.equal(saved, getattr(m, n)) for m, n, saved in second)
    saved_mean = copies.capture()[0][2]
    model.norm.running_mean = torch.zeros(5, dtype=torch.float64)  # another shape: the restore puts the copy in
    restore_buffers([(model.norm, "running_mean", saved_mean)])
    assert model.norm.running_mean is saved_mean
    again = copies.capture()[0][2]
    assert again is not model.norm.running_mean and torch.equal(again, model.norm.running_mean)
    model.eval()
    assert copies.capture() == []  # only modules in training mode: a forward in eval changes nothing


def test_nonfinite_policy_is_checked():
    model = Net()
    with pytest.raises(ValueError, match=r"Invalid nonfinite: 'raise'. Allowed values: stop, skip, None"):
        OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=8, micro_batch=8, nonfinite="raise")


# -- OOM replay -----------------------------------------------------------------------------------

def _guarded_run(model, opt, arm=None, oom_step=2, steps=5, micro=16, dtype=torch.float64, **kwargs):
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=micro, **kwargs)
    model.guard = guard
    torch.manual_seed(7)
    results = []
    for s in range(steps):
        if s == oom_step and arm is not None:
            model.trigger.arm(*arm)
        results.append(guard.step(data(64, dtype=dtype, seed=s), mse))
    return guard, results


def _reference_run(model, opt, micro_per_step, target=64, dtype=torch.float64):
    torch.manual_seed(7)
    for s, micro in enumerate(micro_per_step):
        manual_step(model, opt, data(target, dtype=dtype, seed=s), sizes_for(target, micro))


@pytest.mark.parametrize("at", [1, 3], ids=["first-micro", "third-micro"])
@pytest.mark.parametrize("phase", ["forward", "loss", "backward"])
def test_injected_oom_replays_the_step_as_if_planned_smaller(phase, at):
    (model, opt), (ref, ref_opt) = pair(Net(p=0.2))
    guard, results = _guarded_run(model, opt, arm=(phase, at))
    _reference_run(ref, ref_opt, [16, 16, 8, 8, 8])
    assert max_diff(params_of(model), params_of(ref)) < 1e-12
    assert model.trigger.fired == [(phase, at)]
    assert changes_of(guard) == [(3, "oom", WHERE[phase], 16, 8, 8)]
    assert [r.attempts for r in results] == [1, 1, 2, 1, 1]
    assert model.trigger.sizes == [16] * 8 + [16] * at + [8] * 24  # the failed attempt, then 8s
    assert model.dead_at_replay == [True]  # no activation of the failed attempt outlived it
    assert opt.calls == 5 and guard.ooms == 1


def test_injected_oom_replay_fp32():
    (model, opt), (ref, ref_opt) = pair(Net(p=0.2, dtype=torch.float32))
    _guarded_run(model, opt, arm=("backward", 2), dtype=torch.float32)
    _reference_run(ref, ref_opt, [16, 16, 8, 8, 8], dtype=torch.float32)
    assert_close(params_of(model), params_of(ref), torch.float32)


def test_negative_control_without_rng_restore_the_replay_differs(monkeypatch):
    monkeypatch.setattr(guard_module, "restore_rng", lambda state: None)
    (model, opt), (ref, ref_opt) = pair(Net(p=0.2))
    _guarded_run(model, opt, arm=("backward", 3))
    _reference_run(ref, ref_opt, [16, 16, 8, 8, 8])
    assert max_diff(params_of(model), params_of(ref)) > 1e-6


def _keep_exceptions(monkeypatch) -> list:
    """Keep every exception accumulate sorts (as a logging handler or a debugger might)."""
    kept = []
    is_oom = accumulate_module.is_oom

    def keeping(exc):
        kept.append(exc)
        return is_oom(exc)

    monkeypatch.setattr(accumulate_module, "is_oom", keeping)
    return kept


def test_a_kept_oom_exception_holds_no_activation_once_its_frames_are_cleared(monkeypatch):
    """The frames an OOM unwound lose their locals in the except block (recovery.drop_frames), so
    even an exception someone keeps (and its traceback) keeps no activation of the failed attempt."""
    kept = _keep_exceptions(monkeypatch)
    model, _ = pair(Net(p=0.2))[0]
    _guarded_run(model, torch.optim.SGD(model.parameters(), lr=0.1), arm=("forward", 2), steps=3)
    assert len(kept) == 1 and model.dead_at_replay == [True]


def test_negative_control_a_kept_traceback_keeps_the_failed_activations_alive(monkeypatch):
    """The weakref check can fail: keep the exception (and its traceback) without clearing its
    frames, and it does."""
    _keep_exceptions(monkeypatch)
    monkeypatch.setattr(accumulate_module, "drop_frames", lambda exc: None)
    model, _ = pair(Net(p=0.2))[0]
    _guarded_run(model, torch.optim.SGD(model.parameters(), lr=0.1), arm=("forward", 2), steps=3)
    assert model.dead_at_replay == [False]


def test_plain_runtime_error_from_the_cpu_allocator_counts_as_oom():
    model = Net()
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=64, micro_batch=16)
    calls = [0]

    def loss_fn(m, b):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 4096 bytes.")
        return mse(m, b)

    result = guard.step(data(64), loss_fn)
    assert result.attempts == 2 and changes_of(guard) == [(1, "oom", "forward/loss", 16, 8, 8)]


@pytest.mark.parametrize("case", ["forward-first", "backward-first", "backward-later"])
def test_emulated_budget_oom_replays_the_step_as_if_planned_smaller(case, monkeypatch):
    """A byte budget that micro-batch 64 crosses (in a chosen phase) and 32 does not."""
    target = 128 if case == "backward-later" else 64
    (model, opt), (ref, ref_opt) = pair(Net(hidden=256, p=0.2))
    guard = OOMGuard(model, opt, target_batch=target, micro_batch=64)
    model.guard = guard
    torch.manual_seed(7)
    for s in range(2):
        guard.step(data(target, seed=s), mse)
    big = phase_peaks(model, opt, data(target, seed=2), target, 64)
    small = max(phase_peaks(model, opt, data(target, seed=2), target, 32).values())
    fwd1, bwd1 = big[("forward", 1)], big[("backward", 1)]
    lo, hi = {"forward-first": (small, fwd1),
              "backward-first": (max(small, fwd1), bwd1),
              "backward-later": (max(small, fwd1, bwd1, big.get(("forward", 2), 0)), big.get(("backward", 2), 0))}[case]
    assert lo < hi, f"no budget between {lo} and {hi} bytes for {case}: {big}"
    collections = []
    monkeypatch.setattr(recovery_module.gc, "collect", lambda *a: collections.append(a))
    with emulated_budget((lo + hi) // 2, model, opt) as mem:
        guard.meter = mem  # the guard reads live bytes from the meter: memory came back, no gc needed
        for s in range(2, 5):
            result = guard.step(data(target, seed=s), mse)
            assert result.peak_bytes is not None and (s == 2 or result.peak_bytes <= (lo + hi) // 2)
    assert mem.oom_count == 1 and collections == []
    _reference_run(ref, ref_opt, [64, 64, 32, 32, 32], target=target)
    assert max_diff(params_of(model), params_of(ref)) < 1e-12
    where = "forward/loss" if case == "forward-first" else "backward"
    assert changes_of(guard) == [(3, "oom", where, 64, 32, target // 32)]
    failed = {"forward-first": 0, "backward-first": 1, "backward-later": 2}[case]  # forwards that got through
    assert model.trigger.sizes == [64] * (2 * target // 64 + failed) + [32] * (3 * target // 32)
    assert model.dead_at_replay == [True]


def test_replay_restores_batchnorm_running_stats():
    """The failed attempt's forwards updated the running statistics: the replay starts from the
    statistics the step started with, as a run that planned the smaller micro-batch would."""
    (model, opt), (ref, ref_opt) = pair(Net(p=0.2, batchnorm=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the BatchNorm warning has its own test
        _guarded_run(model, opt, arm=("backward", 3))
    _reference_run(ref, ref_opt, [16, 16, 8, 8, 8])
    assert max_diff(params_of(model), params_of(ref)) < 1e-12
    assert_close(list(model.buffers()), list(ref.buffers()))
    assert int(model.norm.num_batches_tracked) == 4 + 4 + 8 * 3


# -- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [ValueError("label 7 is out of range for 3 classes"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered"),
                                   KeyError("tokens")], ids=["ValueError", "illegal-access", "KeyError"])
@pytest.mark.parametrize("at", [1, 3])
def test_non_oom_error_propagates_unchanged_and_keeps_the_plan(error, at):
    model = Net()
    opt = RecordingSGD(model.parameters(), lr=0.1)
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=16)
    guard.step(data(64, seed=0), mse)
    before, message = params_of(model), str(error)
    calls = [0]

    def loss_fn(m, b):
        calls[0] += 1
        if calls[0] == at:
            raise error
        return mse(m, b)

    with pytest.raises(type(error)) as info:
        guard.step(data(64, seed=1), loss_fn)
    assert info.value is error and str(info.value) == message and type(info.value) is type(error)
    assert calls[0] == at  # not replayed
    assert guard.plan == Plan.for_target(64, 16) and guard.changes == [] and guard.ooms == 0
    assert guard.steps == 1 and opt.calls == 1
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), before))


def test_micro_batch_1_oom_raises_does_not_fit_after_halving_down():
    model = Net()
    model.trigger.cap = 0  # nothing fits
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=4, micro_batch=4)
    with pytest.raises(DoesNotFitError, match="micro-batch of 1 does not fit") as info:
        guard.step(data(4), mse)
    assert model.trigger.sizes == [4, 2, 1]
    assert changes_of(guard) == [(1, "oom", "forward/loss", 4, 2, 2), (1, "oom", "forward/loss", 2, 1, 4)]
    assert info.value.suggestions and "What to do" in str(info.value)


def test_micro_batch_1_oom_under_a_budget_reports_needed_and_available_bytes():
    model = Net(hidden=256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mem = emulated_budget(param_bytes + 1024, model, opt)
    guard = OOMGuard(model, opt, target_batch=4, micro_batch=4, meter=mem)
    with mem, pytest.raises(DoesNotFitError) as info:
        guard.step(data(4), mse)
    assert info.value.available_bytes == param_bytes + 1024
    assert info.value.needed_bytes > info.value.available_bytes and info.value.at_least
    assert [(c.old.micro_batch, c.new.micro_batch) for c in guard.changes] == [(4, 2), (2, 1)]


def test_oom_inside_optimizer_step_raises_and_does_not_replay():
    model = Net()
    opt = RecordingSGD(model.parameters(), lr=0.1)
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=16)
    guard.step(data(64, seed=0), mse)
    opt.fail_next = True
    with pytest.raises(OptimizerStepOOMError, match=r"optimizer\.step\(\) at optimizer step 2.*not replayed"):
        guard.step(data(64, seed=1), mse)
    assert model.trigger.sizes == [16] * 8  # one attempt per step: no replay
    assert guard.changes == [] and guard.plan == Plan.for_target(64, 16) and opt.calls == 2
    assert all(p.grad is None for p in model.parameters())


def test_oom_in_gradient_clipping_raises_before_the_optimizer_steps(monkeypatch):
    model = Net()
    opt = RecordingSGD(model.parameters(), lr=0.1)
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=16, max_grad_norm=1.0)
    before = params_of(model)

    def clip(*args, **kwargs):
        raise torch.OutOfMemoryError("injected OOM in clip_grad_norm_")

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", clip)  # clipping with the norm the check computed
    with pytest.raises(OptimizerStepOOMError, match="gradient clipping"):
        guard.step(data(64), mse)
    assert opt.calls == 0 and guard.changes == [] and model.trigger.sizes == [16] * 4
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), before))


def test_after_an_oom_in_clipping_the_scaler_is_ready_for_the_next_step(monkeypatch):
    """The OOM struck after unscale_: the scaler's record of that is dropped, so a caller who
    goes on (parameters were not touched) gets a normal next step, not "unscale_() already called"."""
    model = Net(dtype=torch.float32)
    opt = RecordingSGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    calls = _counting_unscale(scaler)
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=16, scaler=scaler, max_grad_norm=1.0)
    clip, clip_with_norm = torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grads_with_norm_

    def failing(*args, **kwargs):
        raise torch.OutOfMemoryError("injected OOM in clip_grad_norm_")

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", failing)
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", failing)
    with pytest.raises(OptimizerStepOOMError, match="gradient clipping"):
        guard.step(data(64, dtype=torch.float32), mse)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", clip_with_norm)
    result = guard.step(data(64, dtype=torch.float32, seed=1), mse)
    assert not result.skipped and opt.calls == 1 and calls[0] == 2


# -- plan changes, logging, state -----------------------------------------------------------------

def test_each_plan_change_is_logged_once_in_order(caplog):
    caplog.set_level(logging.WARNING, logger="autoaccum.guard")
    model = Net()
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=64, micro_batch=64)
    model.trigger.arm("forward", 1)
    r0 = guard.step(data(64, seed=0), mse)
    r1 = guard.step(data(64, seed=1), mse)
    model.trigger.arm("backward", 2)
    r2 = guard.step(data(64, seed=2), mse)
    model.trigger.cap = 4  # two halvings within one step
    r3 = guard.step(data(64, seed=3), mse)
    messages = [r.getMessage() for r in caplog.records if r.name == "autoaccum.guard"]
    assert messages == [
        "OOM in forward/loss: batch 64 = 64 -> 32 x 2 (2 micro-batches); the global batch is unchanged",
        "OOM in backward: batch 64 = 32 x 2 -> 16 x 4 (4 micro-batches); the global batch is unchanged",
        "OOM in forward/loss: batch 64 = 16 x 4 -> 8 x 8 (8 micro-batches); the global batch is unchanged",
        "OOM in forward/loss: batch 64 = 8 x 8 -> 4 x 16 (16 micro-batches); the global batch is unchanged",
    ]
    assert [len(r.changes) for r in (r0, r1, r2, r3)] == [1, 0, 1, 2]
    assert [r.attempts for r in (r0, r1, r2, r3)] == [2, 1, 2, 3]
    assert list(r0.changes + r2.changes + r3.changes) == guard.changes
    assert [c.step for c in guard.changes] == [1, 3, 4, 4]
    assert [r.plan.micro_batch for r in (r0, r1, r2, r3)] == [32, 32, 16, 4]


def test_batch_of_the_wrong_size_is_a_value_error_before_any_work():
    model = Net()
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=64, micro_batch=16)
    with pytest.raises(ValueError, match=r"batch holds 63 samples.* is 64 \(pass partial=True"):
        guard.step(data(63), mse)
    with pytest.raises(ValueError, match="batch holds 65 samples"):
        guard.step(data(65), mse)
    with pytest.raises(ValueError, match="batch holds 65 samples"):
        guard.step(data(65), mse, partial=True)
    with pytest.raises(ValueError, match="batch holds 0 samples"):
        guard.step(data(0), mse, partial=True)
    assert model.trigger.sizes == [] and guard.steps == 0


@DTYPES
def test_partial_last_batch_is_an_exact_step_on_its_samples(dtype):
    (model, opt), (ref, ref_opt) = pair(Net(dtype=dtype))
    guard = OOMGuard(model, opt, target_batch=64, micro_batch=16)
    guard.step(data(64, dtype=dtype, seed=0), mse)
    full_step(ref, ref_opt, data(64, dtype=dtype, seed=0))
    result = guard.step(data(40, dtype=dtype, seed=1), mse, partial=True)
    full_loss, _ = full_step(ref, ref_opt, data(40, dtype=dtype, seed=1))
    assert result.num_samples == 40 and result.loss == pytest.approx(full_loss, rel=1e-5)
    assert model.trigger.sizes == [16] * 4 + [14, 13, 13]  # 40 samples spread over the 3 micro-steps it needs
    assert_close(opt.grads[1], ref_opt.grads[1], dtype)
    assert_close(params_of(model), params_of(ref), dtype)
    assert guard.plan == Plan.for_target(64, 16)


def test_state_dict_carries_the_micro_batch_to_a_fresh_guard():
    model = Net()
    model.trigger.cap = 20
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = OOMGuard(model, opt, target_batch=64, micro_batch=64)
    first.step(data(64), mse)
    assert first.plan == Plan.for_target(64, 16)
    state = copy.deepcopy(first.state_dict())
    fresh = OOMGuard(model, opt, target_batch=64, micro_batch=64)
    fresh.load_state_dict(state)
    assert fresh.plan == first.plan and (fresh.steps, fresh.ooms) == (1, 2)
    fired = len(model.trigger.fired)
    assert fresh.step(data(64, seed=1), mse).attempts == 1
    assert len(model.trigger.fired) == fired  # no rediscovery
    other = OOMGuard(model, opt, target_batch=32, micro_batch=32)
    with pytest.raises(ValueError, match="target_batch 64"):
        other.load_state_dict(state)


def test_batchnorm_with_accumulation_warns_once_naming_the_layers():
    model = Net(batchnorm=True)
    with pytest.warns(UserWarning, match=r"BatchNorm layers \(norm\).*SyncBatchNorm.*GroupNorm") as record:
        guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=64, micro_batch=16)
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.trigger.arm("backward", 2)
        guard.step(data(64), mse)  # a shrink does not warn again
        guard.step(data(64, seed=1), mse)


def test_no_batchnorm_warning_without_batchnorm_or_without_accumulation():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = Net()
        OOMGuard(plain, torch.optim.SGD(plain.parameters(), lr=0.1), target_batch=64, micro_batch=16)
        bn = Net(batchnorm=True)
        guard = OOMGuard(bn, torch.optim.SGD(bn.parameters(), lr=0.1), target_batch=64, micro_batch=64)
        guard.step(data(64), mse)
    bn.trigger.arm("forward", 1)
    with pytest.warns(UserWarning, match=r"BatchNorm layers \(norm\)"):
        guard.step(data(64), mse)  # the OOM brought accumulation: now it matters


def test_wrap_gives_the_same_result_as_step():
    (model, opt), (ref, ref_opt) = pair(Net(p=0.2))
    wrapped_guard = OOMGuard(model, opt, target_batch=64, micro_batch=16, max_grad_norm=0.5)
    guard = OOMGuard(ref, ref_opt, target_batch=64, micro_batch=16, max_grad_norm=0.5)

    @wrapped_guard.wrap
    def train_step(batch):
        """Forward and loss of one micro-batch."""
        x, y = batch
        return F.mse_loss(model(x), y)

    results = []
    for run, m in ((lambda b, **kw: train_step(b, **kw)), model), ((lambda b, **kw: guard.step(b, mse, **kw)), ref):
        torch.manual_seed(3)
        m.trigger.sizes = []
        out = []
        for s in range(3):
            if s == 1:
                m.trigger.arm("forward", 2)
            out.append(run(data(64, seed=s)))
        out.append(run(data(20, seed=9), partial=True))
        results.append(out)
    assert [r.loss for r in results[0]] == [r.loss for r in results[1]]
    assert [r.changes for r in results[0]] == [r.changes for r in results[1]]
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(ref)))
    assert train_step.__doc__ == "Forward and loss of one micro-batch."
    assert train_step.__wrapped__.__name__ == "train_step"


def test_invalid_arguments_name_the_value_and_the_range():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"Invalid max_grad_norm: -1.*Allowed range"):
        OOMGuard(model, opt, target_batch=64, micro_batch=8, max_grad_norm=-1)
    with pytest.raises(TypeError, match="plan=, or target_batch= and micro_batch="):
        OOMGuard(model, opt, target_batch=64)
    with pytest.raises(TypeError, match=r"give plan= or micro_batch=, not both \(micro_batch=16\)"):
        OOMGuard(model, opt, plan=Plan.for_target(64, 8), micro_batch=16)  # the plan used to win silently
    with pytest.raises(ValueError, match="plan is for target_batch 64, this run.s is 32"):
        OOMGuard(model, opt, target_batch=32, plan=Plan.for_target(64, 8))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        OOMGuard(model, object(), target_batch=64, micro_batch=8)
    with pytest.raises(ValueError, match="grow_after"):
        OOMGuard(model, opt, target_batch=64, micro_batch=8, grow_after=0)


# -- on a real device -----------------------------------------------------------------------------

@pytest.mark.gpu
def test_real_cuda_oom_replays_the_step_as_if_planned_smaller():
    """The CUDA allocator itself raises (a per-process memory cap between the peaks of micro-batch
    256 and 512); the run ends equal to one that planned 256 from that step on, dropout included."""
    device = torch.device("cuda", torch.cuda.current_device())

    def make():
        model = Net(d_in=64, hidden=8192, p=0.2).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def batch(s):
        return tuple(t.to(device) for t in data(1024, d_in=64, seed=s))

    def peak(micro):
        model, opt = make()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for s in range(2):
            OOMGuard(model, opt, target_batch=1024, micro_batch=micro).step(batch(s), mse)
        return torch.cuda.max_memory_allocated()

    big, small = peak(512), peak(256)
    assert small < 0.8 * big
    (model, opt), (ref, ref_opt) = make(), make()
    guard = OOMGuard(model, opt, target_batch=1024, micro_batch=512)
    model.guard = guard
    torch.manual_seed(7)
    for s in range(2):
        guard.step(batch(s), mse)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction((small + big) / 2 / total, device)
    try:
        for s in range(2, 6):
            guard.step(batch(s), mse)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert [c[:2] + c[3:] for c in changes_of(guard)] == [(3, "oom", 512, 256, 4)]  # and no thrash shrink
    assert model.dead_at_replay == [True]
    torch.manual_seed(7)
    for s, micro in enumerate([512, 512, 256, 256, 256, 256]):
        manual_step(ref, ref_opt, batch(s), sizes_for(1024, micro))
    assert max_diff(params_of(model), params_of(ref)) < 1e-12


def test_removed_and_misspelt_options_are_refused_by_name():
    """``overlap=`` was removed: refused with the reason, not Python's bare "unexpected keyword"; a typo gets
    the closest known option. Control: the same guard without them builds."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"OOMGuard: overlap= was removed: .*0\.814x"):
        OOMGuard(model, opt, target_batch=64, micro_batch=32, overlap="on")
    with pytest.raises(TypeError, match=r"unknown option 'grow_aftr'; did you mean 'grow_after'\?"):
        OOMGuard(model, opt, target_batch=64, micro_batch=32, grow_aftr=2)
    assert OOMGuard(model, opt, target_batch=64, micro_batch=32).plan.micro_batch == 32
