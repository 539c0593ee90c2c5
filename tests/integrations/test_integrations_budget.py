"""``budget=`` in the three integrations means what it means in ``fit``: the memory the run plans for and, off
CUDA, the memory it is held to -- each step runs on an emulated device of that size, where an allocation past
it raises a real ``torch.OutOfMemoryError`` that the guard replays on the same samples.

Every run here gives ``budget=`` alone, with no ``autoaccum.emulated_budget`` around the training, and is
compared with its framework's own full-batch run (the harnesses of tests/integrations/test_integrations_hf.py,
test_integrations_lightning.py and test_integrations_accelerate.py). Negative controls: the same micro-batch
without ``budget=`` runs whole, with no OOM (before, ``budget=`` only sized the probe's plan, so nothing
held a given micro-batch). ``budget=`` inside an ``emulated_budget(...)`` block is refused: two budgets.
"""

from __future__ import annotations

import pytest
import torch

from autoaccum import emulated_budget, parse_bytes
from autoaccum.integrations.lazy_guard import LazyGuard, check_options
from autoaccum.memory import NullMeter, TrackedMemory

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
pl = pytest.importorskip("lightning.pytorch")

import test_integrations_accelerate as acc  # noqa: E402 - after the skips
import test_integrations_hf as hf  # noqa: E402
import test_integrations_lightning as light  # noqa: E402
from _token_rows import Rows, collate, gpt2  # noqa: E402
from helpers import params, rel_diff  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from autoaccum.integrations.accelerate import guard_for  # noqa: E402
from autoaccum.integrations.lightning import AutoAccum  # noqa: E402
from autoaccum.integrations.transformers import AutoAccumTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10
TOKEN_BUDGET, TOKEN_LOWER = "2MiB", "1.45MiB"  # GPT-2 rows: micro-batches up to 3 fit; after the drop, 1
#: the two-budget refusal's words, for budget='2MiB' inside emulated_budget("3MiB")
TWO_BUDGETS = (r"budget='2MiB' and autoaccum\.emulated_budget\(3 MiB\) around the training are two budgets for one "
               r"run: budget= is the memory the probe plans for and, off CUDA, the emulated device each step runs on "
               r"\(in fit and the integrations alike\)\. Give one: budget='2MiB' alone, outside any "
               r"emulated_budget\(\.\.\.\) block, or the emulated_budget\(\.\.\.\) block alone, without budget=")


def held(lazy, budget: str) -> None:
    """``lazy``'s guard ran on ``budget=``'s emulated device and no step peaked past it."""
    assert isinstance(lazy.emulated, TrackedMemory) and lazy.guard.meter is lazy.emulated
    assert lazy.emulated.budget_bytes == parse_bytes(budget)
    assert 0 < lazy.emulated.peak_bytes <= parse_bytes(budget)


def fresh_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# == Accelerate =================================================================================================
@pytest.fixture(scope="module")
def acc_reference(one_thread):
    fresh_accelerate_state()
    out = acc.run(False)
    fresh_accelerate_state()
    return out


def test_accelerate_budget_alone_plans_for_it_and_holds_each_step_to_it(acc_reference):
    """The probe plans for 2 MiB; the device then has 1.45 MiB after step 2: step 3 runs out of memory on it
    and is replayed smaller, on the same samples. Equal to Accelerate's full-batch loop."""
    out = acc.run(True, guard_budget=TOKEN_BUDGET, drop=(2, TOKEN_LOWER))
    lazy, guard = out["guard"], out["guard"].guard
    assert lazy.plan_source == "probe" and lazy.report.plan.accum_steps > 1  # planned for the budget
    held(lazy, TOKEN_LOWER)
    # one OOM after the drop (at step 3 or, where the probe's plan checkpoints and a step's rows are shorter, later)
    assert guard.ooms == 1 and [c.reason for c in guard.changes] == ["oom"] and guard.changes[0].step >= 3
    assert out["audit"].check() == {"steps": acc.STEPS, "repeated": 0, "inconsistent": 0}
    assert rel_diff(out["params"], acc_reference["params"]) <= RTOL
    fresh_accelerate_state()


def test_accelerate_a_given_micro_batch_that_does_not_fit_the_budget_is_replayed(acc_reference):
    """micro_batch=8 with budget= (off CUDA: the device it runs on) runs out of memory at step 1 and is replayed
    smaller; negative control: the same micro-batch without budget= runs whole (nothing held it)."""
    out = acc.run(True, micro_batch=8, guard_budget=TOKEN_BUDGET)
    guard = out["guard"].guard
    held(out["guard"], TOKEN_BUDGET)
    assert guard.ooms == 1 and [(c.step, c.reason) for c in guard.changes] == [(1, "oom")]
    assert guard.plan.micro_batch < 8 and out["steps"] == acc.STEPS
    assert rel_diff(out["params"], acc_reference["params"]) <= RTOL
    fresh_accelerate_state()
    free = acc.run(True, micro_batch=8)
    assert free["guard"].emulated is None and isinstance(free["guard"].guard.meter, NullMeter)
    assert free["guard"].guard.ooms == 0 and free["guard"].guard.plan.micro_batch == 8
    fresh_accelerate_state()


def test_accelerate_budget_inside_an_emulated_budget_is_refused():
    """At guard_for inside the block; and for a guard built outside it, at the first step inside it, before the
    probe. Negative control: that guard outside the block runs."""
    fresh_accelerate_state()
    accelerator = accelerate.Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Rows(), batch_size=8, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with emulated_budget("3MiB"), pytest.raises(TypeError, match=TWO_BUDGETS):
        guard_for(accelerator, model, optimizer, budget="2MiB")
    guard = guard_for(accelerator, model, optimizer, budget="2MiB")
    batch = next(iter(loader))
    with emulated_budget("3MiB", model), pytest.raises(TypeError, match=TWO_BUDGETS):
        guard.accumulate(batch, acc.default_loss)
    assert guard.guard is None and guard.report is None  # refused before any work
    guard.accumulate(batch, acc.default_loss)
    assert guard.guard.steps == 1
    fresh_accelerate_state()


def test_a_closed_emulated_device_takes_no_step_and_a_second_meter_is_refused():
    """After ``close()`` (the end of training) the emulated device counts nothing: a step there is refused rather
    than run on no device of that size. A ``meter=`` next to budget= off CUDA would be a second device."""
    fresh_accelerate_state()
    accelerator = accelerate.Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = collate([Rows()[i] for i in range(8)])
    guard = guard_for(accelerator, model, optimizer, budget="2MiB")
    guard.accumulate(batch, acc.default_loss)
    guard.close()
    with pytest.raises(RuntimeError, match=r"emulated device was closed at the end of its training"):
        guard.accumulate(batch, acc.default_loss)
    assert guard.guard.steps == 1
    with pytest.raises(TypeError, match=r"budget= off CUDA is the emulated device .*meter= would be another"):
        LazyGuard(model, optimizer, budget="2MiB", meter=TrackedMemory())
    fresh_accelerate_state()


# == Hugging Face Trainer ========================================================================================
class _Lower(TrainerCallback):
    """Lowers the budget of the trainer's own emulated device after a given step."""

    def __init__(self, step: int, budget: str) -> None:
        self.step, self.budget, self.trainer = step, parse_bytes(budget), None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.trainer.autoaccum_guard.emulated.budget_bytes = self.budget


def hf_run(out: str, *, lower: _Lower | None = None, **options) -> tuple[AutoAccumTrainer, dict]:
    model = gpt2()
    trainer = AutoAccumTrainer(model=model, args=hf.arguments(out, hf.PER_DEVICE, hf.ACCUM), train_dataset=Rows(),
                               data_collator=collate, callbacks=[] if lower is None else [lower], **options)
    if lower is not None:
        lower.trainer = trainer
    trainer.train()
    return trainer, params(model)


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory, one_thread):
    """HF's own full-batch run: per device 8, no accumulation."""
    model = gpt2()
    hf.train(Trainer, model, hf.arguments(str(tmp_path_factory.mktemp("ref")), 8, 1))
    return params(model)


def test_hf_budget_alone_plans_for_it_and_holds_each_step_to_it(hf_reference, tmp_path):
    trainer, got = hf_run(str(tmp_path), lower=_Lower(2, TOKEN_LOWER), budget=TOKEN_BUDGET)
    lazy, guard = trainer.autoaccum_guard, trainer.autoaccum_guard.guard
    assert lazy.plan_source == "probe" and lazy.report.plan.accum_steps > 1
    held(lazy, TOKEN_LOWER)
    assert guard.ooms == 1 and [(c.step, c.reason) for c in guard.changes] == [(3, "oom")]
    assert trainer.state.global_step == hf.STEPS
    assert rel_diff(got, hf_reference) <= RTOL


def test_hf_a_given_micro_batch_that_does_not_fit_the_budget_is_replayed(hf_reference, tmp_path):
    trainer, got = hf_run(str(tmp_path / "held"), micro_batch=8, budget=TOKEN_BUDGET)
    guard = trainer.autoaccum_guard.guard
    held(trainer.autoaccum_guard, TOKEN_BUDGET)
    assert guard.ooms == 1 and [(c.step, c.reason) for c in guard.changes] == [(1, "oom")]
    assert rel_diff(got, hf_reference) <= RTOL
    free, _ = hf_run(str(tmp_path / "free"), micro_batch=8)  # negative control
    assert free.autoaccum_guard.emulated is None and free.autoaccum_guard.guard.ooms == 0
    assert free.autoaccum_guard.guard.plan.micro_batch == 8


def test_hf_budget_inside_an_emulated_budget_is_refused(tmp_path):
    args = hf.arguments(str(tmp_path), hf.PER_DEVICE, hf.ACCUM)
    with emulated_budget("3MiB"), pytest.raises(TypeError, match=TWO_BUDGETS):
        AutoAccumTrainer(model=gpt2(), args=args, train_dataset=Rows(), data_collator=collate, budget="2MiB")
    trainer = AutoAccumTrainer(model=gpt2(), args=args, train_dataset=Rows(), data_collator=collate, budget="2MiB")
    with emulated_budget("3MiB"), pytest.raises(TypeError, match=TWO_BUDGETS):
        trainer.train()  # the documented emulated_budget pattern, with budget= as well: refused at the first step
    assert trainer.state.global_step == 0 and trainer.autoaccum_guard is None  # no guard built, nothing probed


# == Lightning =================================================================================================
class _LowerLightning(pl.Callback):
    """Lowers the budget of AutoAccum's own emulated device after a given step."""

    def __init__(self, callback: AutoAccum, step: int, budget: str) -> None:
        self.callback, self.step, self.budget = callback, step, parse_bytes(budget)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.callback.guard.emulated.budget_bytes = self.budget


@pytest.fixture(scope="module")
def light_reference(one_thread):
    module, _, _ = light.fit()
    return light.params(module)


def test_lightning_budget_alone_plans_for_it_and_holds_each_step_to_it(light_reference):
    callback = AutoAccum(budget=light.BUDGET)
    module, run, _ = light.fit(callback, _LowerLightning(callback, 2, light.LOWER))
    lazy, guard = callback.guard, callback.guard.guard
    assert lazy.plan_source == "probe" and lazy.report.plan.accum_steps > 1
    held(lazy, light.LOWER)
    assert guard.ooms == 1 and [(c.step, c.reason) for c in guard.changes] == [(3, "oom")]
    assert run.global_step == light.STEPS and module.audit.check()["inconsistent"] == 0
    assert light.rel_diff(light.params(module), light_reference) <= RTOL


def test_lightning_a_given_micro_batch_that_does_not_fit_the_budget_is_replayed(light_reference):
    callback = AutoAccum(budget=light.BUDGET, micro_batch=light.GLOBAL)
    module, _, _ = light.fit(callback)
    guard = callback.guard.guard
    held(callback.guard, light.BUDGET)
    # at step 2: the momentum Lightning's first optimizer step made (outside the guard's step) is on the device too
    assert guard.ooms == 1 and [(c.step, c.reason) for c in guard.changes] == [(2, "oom")]
    assert guard.plan.micro_batch < light.GLOBAL
    assert light.rel_diff(light.params(module), light_reference) <= RTOL
    free = AutoAccum(micro_batch=light.GLOBAL)  # negative control
    light.fit(free)
    assert free.guard.emulated is None and free.guard.guard.ooms == 0
    assert free.guard.guard.plan.micro_batch == light.GLOBAL


def test_lightning_budget_inside_an_emulated_budget_is_refused():
    with emulated_budget("3MiB"), pytest.raises(TypeError, match=TWO_BUDGETS):
        AutoAccum(budget="2MiB")
    callback = AutoAccum(budget="2MiB")
    with emulated_budget("3MiB"), pytest.raises(TypeError, match=TWO_BUDGETS):
        light.trainer(callback).fit(light.Module(), light.loader())  # at setup, before any step
    assert callback.guard is None


# == the rule on CUDA ==========================================================================================
def test_on_cuda_budget_next_to_a_given_plan_would_mean_nothing_and_is_refused():
    """On CUDA budget= is only what the probe plans for, and plan=/micro_batch= skip the probe; off CUDA it is
    also the emulated device, so the pair means something there (as in fit)."""
    with pytest.raises(TypeError, match=r"budget= is the memory the probe plans for, and micro_batch= skips the probe; "
                                        r"on CUDA no emulated device runs either .* would mean nothing on cuda\. "
                                        r"Give budget= alone \(the probe plans for it\) or micro_batch= alone"):
        check_options(budget="2MiB", micro_batch=3, device="cuda")
    plan = {"micro_batch": 4, "accum_steps": 2, "world_size": 1, "target_batch": 8}
    with pytest.raises(TypeError, match=r"and plan= skips the probe; on CUDA"):
        check_options(budget="2MiB", plan=plan, device=torch.device("cuda", 0))
    check_options(budget="2MiB", micro_batch=3, device="cpu")
    check_options(budget="2MiB", micro_batch=3)  # the device not known yet: checked where it is


def test_a_compiled_model_under_budget_off_cuda_is_refused_as_fit_refuses_it():
    """torch.compile compiles nothing inside the emulated device's counter: eager numbers reported as compiled.
    Negative control: the same compiled model without budget= is taken."""
    fresh_accelerate_state()
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.compile(gpt2())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"cannot train it under an emulated budget \(budget= off CUDA\): the model "
                                         r"is torch.compile'd"):
        guard_for(accelerator, model, optimizer, budget="2MiB")
    assert guard_for(accelerator, model, optimizer, micro_batch=4).emulated is None
    fresh_accelerate_state()
