"""``AutoAccum`` (autoaccum.integrations.lightning) against Lightning's own full-batch run.

The LightningModule is an unchanged user module (an MLP predicting 4 positions of 3 classes, a
mean cross-entropy); the reference is the same Trainer without the callback on the same DataLoader
of global batches of 16. fp64, gradient clipping at 1.0, SGD with momentum and a per-step LambdaLR
schedule. Sample ids ride in the batch and are recorded by the module's own ``training_step``;
the audit keeps only micro-batches whose gradients reached the optimizer step.
"""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
from _audit import IdAudit
from _mlp_rows import N, mean_loss, mlp, samples
from _mlp_rows import token_loss as summed
from helpers import params, rel_diff

from autoaccum import emulated_budget, parse_bytes

pl = pytest.importorskip("lightning.pytorch")

from autoaccum.integrations.lightning import AutoAccum  # noqa: E402 - after the skip

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10
GLOBAL, EPOCHS = 16, 2
STEPS = EPOCHS * N // GLOBAL
BUDGET = "380KiB"  # micro-batches up to 5 fit: 4 x 4
LOWER = "330KiB"  # after step 2: micro 4 no longer fits, 2 does
# under DDP each rank also holds DDP's buckets and the guard's flat all-reduce buffer (a gradient's worth each)
DDP_BUDGET, DDP_LOWER = "540KiB", "500KiB"  # a step at micro 4 peaks at 508 KiB, at 2 at 492 KiB


@pytest.fixture(autouse=True)
def _quiet_lightning():
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|LeafSpec).*")
        yield


class Module(pl.LightningModule):
    """What a user writes: a mean loss over the batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.audit = IdAudit(self.net)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.audit.forward(batch["ids"].tolist())
        loss = mean_loss(self.net, batch)
        self.log("train_loss", loss, batch_size=len(batch["ids"]))
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def token_loss(module: Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``AutoAccum(loss_fn=...)``: the module's loss as (sum over targets, their count)."""
    module.audit.forward(batch["ids"].tolist())
    return summed(module.net, batch)


def loader(padded: bool = False, batch_sampler=None) -> torch.utils.data.DataLoader:
    if batch_sampler is not None:
        return torch.utils.data.DataLoader(samples(padded), batch_sampler=batch_sampler)
    return torch.utils.data.DataLoader(samples(padded), batch_size=GLOBAL)


class Watch(pl.Callback):
    """The audit's step before Lightning's optimizer step; optimizer steps counted; optionally a budget drop."""

    def __init__(self, drop: tuple[int, object, int] | None = None) -> None:
        self.drop, self.optimizer_steps = drop, 0

    def on_train_start(self, trainer, pl_module):
        pl_module.audit.watch(trainer.optimizers[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pl_module.audit.step()
        self.optimizer_steps += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.drop is not None and trainer.global_step == self.drop[0]:
            self.drop[1].budget_bytes = self.drop[2]


def trainer(*callbacks: pl.Callback, **kwargs) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
    options.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **options)


def fit(*callbacks: pl.Callback, budget=None, drop_after=None, data=None, ckpt_path=None, **kwargs):
    module = Module()
    meter = emulated_budget(budget, module) if budget is not None else None
    watch = Watch(None if drop_after is None else (drop_after, meter, parse_bytes(LOWER)))
    run = trainer(*callbacks, watch, **kwargs)
    if meter is None:
        run.fit(module, data or loader(), ckpt_path=ckpt_path)
    else:
        with meter:
            run.fit(module, data or loader(), ckpt_path=ckpt_path)
    return module, run, watch


@pytest.fixture(scope="module")
def reference(one_thread):
    """Lightning's own run: one forward/backward per global batch."""
    module, _, _ = fit()
    return {"params": params(module), "steps": module.audit.steps}


def test_under_a_budget_that_forces_accumulation_it_equals_lightnings_full_batch_run(reference):
    callback = AutoAccum()
    module, run, watch = fit(callback, budget=BUDGET)
    plan = callback.guard.guard.plan
    assert callback.guard.plan_source == "probe" and plan.target_batch == GLOBAL and plan.accum_steps > 1
    assert rel_diff(params(module), reference["params"]) <= RTOL
    assert module.audit.steps == reference["steps"]  # the same samples per step, in the same order
    assert module.audit.check() == {"steps": STEPS, "repeated": N, "inconsistent": 0}  # 2 epochs: each twice
    assert run.global_step == watch.optimizer_steps == run.lr_scheduler_configs[0].scheduler.last_epoch == STEPS
    assert run.callback_metrics["autoaccum/micro_batch"] == plan.micro_batch  # the plan in Lightning's logs
    assert run.callback_metrics["autoaccum/accum_steps"] == plan.accum_steps
    assert not {"training_step", "backward", "optimizer_zero_grad"} & set(vars(module))  # the module as it was


def test_the_budget_dropped_mid_run_is_recovered_in_place(reference, caplog):
    callback = AutoAccum(micro_batch=4)
    with caplog.at_level(logging.WARNING, logger="autoaccum"):
        module, run, _ = fit(callback, budget=BUDGET, drop_after=2)
    guard = callback.guard.guard
    assert guard.ooms >= 1 and guard.plan.micro_batch < 4
    assert [c.step for c in guard.changes] == [3] * len(guard.changes)  # the third step was replayed smaller
    assert "batch 16 = " in caplog.text and "; the global batch is unchanged" in caplog.text
    assert run.callback_metrics["autoaccum/micro_batch"] == guard.plan.micro_batch
    assert module.audit.steps == reference["steps"]  # nothing repeated or lost
    assert module.audit.check()["inconsistent"] == 0
    assert rel_diff(params(module), reference["params"]) <= RTOL


def test_checkpoint_and_resume_keep_working_and_keep_the_plan(reference, tmp_path):
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1)
    fit(AutoAccum(micro_batch=5), checkpoints, enable_checkpointing=True)
    first_epoch = tmp_path / "epoch=0-step=4.ckpt"
    assert torch.load(first_epoch, weights_only=False)["callbacks"]["AutoAccum"]["plan"]["micro_batch"] == 4
    callback = AutoAccum()  # no plan: it would probe, but the checkpoint brings the plan
    module, run, _ = fit(callback, enable_checkpointing=True, ckpt_path=str(first_epoch),
                         default_root_dir=str(tmp_path / "resumed"))
    assert callback.guard.plan_source == "checkpoint" and callback.guard.guard.plan.micro_batch == 4
    assert module.audit.steps == reference["steps"][STEPS // 2:]  # the second epoch
    assert rel_diff(params(module), reference["params"]) <= RTOL
    assert run.global_step == run.lr_scheduler_configs[0].scheduler.last_epoch == STEPS


def test_a_token_level_loss_is_exact_through_loss_fn_and_a_mean_of_means_is_not():
    """Rows keep 1..4 targets: the module's mean is over valid targets. Weighting micro-batch means by
    samples is then not the full-batch mean (negative control); ``loss_fn`` returning (sum, count)
    divides the step once by all its targets."""
    ref, _, _ = fit(data=loader(padded=True))
    plain, _, _ = fit(AutoAccum(micro_batch=5), data=loader(padded=True))
    assert rel_diff(params(plain), params(ref)) > 1e-6
    exact, _, _ = fit(AutoAccum(micro_batch=5, loss_fn=token_loss), data=loader(padded=True))
    assert rel_diff(params(exact), params(ref)) <= RTOL
    assert exact.audit.steps == ref.audit.steps


def test_what_it_cannot_run_is_refused_before_training():
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2: give the DataLoader batch_size"):
        fit(AutoAccum(), accumulate_grad_batches=2)


@pytest.mark.parametrize(("options", "error", "says"), [
    ({"headroom": -0.1}, ValueError, r"Invalid headroom: -0.1\. Allowed range: 0 <= headroom < 1"),
    ({"micro_batch": 2.5}, TypeError, r"micro_batch"),
    ({"budgett": "2MiB"}, TypeError, r"AutoAccum got an unknown option 'budgett'; did you mean 'budget'\?"),
    ({"plan": "no/such/plan.json"}, ValueError, r"Invalid plan file"),
    ({"loss_fn": lambda batch, module: batch}, TypeError, r"loss_fn takes \(batch, module\), but it is called as "
     r"loss_fn\(model, batch\): the arguments are swapped"),
])
def test_the_callbacks_options_are_checked_when_it_is_built(options, error, says):
    with pytest.raises(error, match=says):
        AutoAccum(**options)


# -- accumulate_grad_batches changed during training --------------------------------------------------------------
class _Linear(pl.LightningModule):
    """``Linear(3, 1)``, SGD at lr 0.1, a mean squared error: 4 samples in batches of 2."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1).double()

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_linear(*callbacks: pl.Callback) -> tuple[_Linear, pl.Trainer]:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4, 3, generator=g, dtype=torch.float64),
                                          torch.randn(4, 1, generator=g, dtype=torch.float64))
    module = _Linear()
    run = trainer(*callbacks, gradient_clip_val=None)
    run.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    return module, run


class _AccumulateFromEpoch1(pl.Callback):
    """Another way to change it: a callback sets it at epoch 1's start, after AutoAccum's setup."""

    def on_train_epoch_start(self, trainer, pl_module):
        trainer.accumulate_grad_batches = 1 if trainer.current_epoch == 0 else 2


def test_a_gradient_accumulation_schedule_that_changes_the_batch_is_refused_before_training():
    """Lightning with the schedule steps once per 2 batches from epoch 1; AutoAccum would step on the last
    batch alone there (0.07 from Lightning's run). Refused at setup, before any step, with what to do."""
    schedule = pl.callbacks.GradientAccumulationScheduler({1: 2})
    with pytest.raises(ValueError, match=r"GradientAccumulationScheduler\(\{1: 2, 0: 1\}\): it sets "
                                         r"accumulate_grad_batches.*drop the change, or train each phase"):
        _fit_linear(schedule, AutoAccum(micro_batch=1))


def test_accumulate_grad_batches_changed_by_a_callback_is_refused_at_the_batch_where_it_changed():
    callback = AutoAccum(micro_batch=1)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches became 2 at epoch 1 \(step 2\); it must stay 1"):
        _fit_linear(_AccumulateFromEpoch1(), callback)
    assert callback.guard.guard.steps == 2  # epoch 0 trained; the first batch of epoch 1 was refused


def test_negative_control_a_schedule_that_keeps_1_is_accepted_and_equals_lightnings_run():
    reference, _ = _fit_linear(pl.callbacks.GradientAccumulationScheduler({0: 1, 1: 1}))
    module, run = _fit_linear(pl.callbacks.GradientAccumulationScheduler({0: 1, 1: 1}), AutoAccum(micro_batch=1))
    assert run.global_step == 4 and rel_diff(params(module), params(reference)) <= RTOL


# -- Lightning's DDP strategy on two CPU processes -------------------------------------------------------
def _ddp_fit(rank: int, world_size: int, budget: str, lower: str) -> dict:
    """Each rank: the same module and Trainer(strategy="ddp", devices=2), as torchrun would start it
    (the process group exists; Lightning takes it). Rank 1 alone has its budget lowered after step 2."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    module, callback = Module(), AutoAccum(micro_batch=4)
    meter = emulated_budget(budget, module)
    run = trainer(callback, Watch((2, meter, parse_bytes(lower)) if rank == 1 else None), strategy="ddp",
                  devices=world_size, max_epochs=1)
    with meter:
        run.fit(module, torch.utils.data.DataLoader(samples(), batch_size=GLOBAL // world_size))
    guard = callback.guard.guard
    return {"params": params(module), "steps": module.audit.steps, "plan": guard.plan.to_dict(),
            "changes": [(c.step, c.reason, c.where) for c in guard.changes], "ooms": guard.ooms,
            "global_step": run.global_step, "strategy": type(run.strategy).__name__}


@pytest.mark.slow  # two spawned processes, each importing its framework
def test_lightnings_ddp_strategy_on_two_processes_with_an_oom_on_one_rank(tmp_path):
    from test_distributed import results, spawn

    codes, _ = spawn(_ddp_fit, tmp_path, budget=DDP_BUDGET, lower=DDP_LOWER)
    ranks = results(tmp_path, codes)
    steps = N // GLOBAL  # one epoch
    assert [r["strategy"] for r in ranks] == ["DDPStrategy"] * 2 and [r["global_step"] for r in ranks] == [steps] * 2
    # rank 1 alone ran out of memory at step 3; both ranks replayed it with the same smaller micro-batch
    assert [[c[:2] for c in r["changes"]] for r in ranks] == [[(3, "oom")]] * 2
    assert ranks[0]["changes"][0][2] == "another rank" and ranks[0]["plan"] == ranks[1]["plan"]
    assert ranks[0]["plan"]["micro_batch"] < 4 and ranks[0]["plan"]["world_size"] == 2
    assert rel_diff(ranks[0]["params"], ranks[1]["params"]) == 0  # every rank holds the same model
    # each step's global batch is the two ranks' shares: disjoint, every sample once
    batches = [sorted(a + b) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"])]
    assert [len(b) for b in batches] == [GLOBAL] * steps and sorted(i for b in batches for i in b) == list(range(N))
    # Lightning in one process, one forward/backward per global batch, on those batches
    ref, _, _ = fit(data=loader(batch_sampler=batches), max_epochs=1)
    assert rel_diff(ranks[0]["params"], params(ref)) <= RTOL
