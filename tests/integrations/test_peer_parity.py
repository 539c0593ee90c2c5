"""Peer parity: each integration held to what its framework's own gradient-accumulation tests assert.

The frameworks test their accumulation against a run without it: Hugging Face's Trainer that the
logged loss of each step is the same with and without accumulation and that the trained weights
agree; Accelerate (``test_sync.py``) that at every sync point the gradients equal those of a
ground-truth model stepped on the whole batch, that the learning rate follows step for step, and
that the last, shorter window of an epoch syncs too; Lightning that the optimizer steps, and
``zero_grad`` is called, once per window, the last short one included. Each block here makes those
assertions of the autoaccum integration, written from that intent: the reference is the framework's
own run with one forward/backward per global batch on the same samples in the same order, and the
integration runs under an emulated budget that forces small micro-batches and drops after step 2,
so that step 3 runs out of memory and is replayed smaller. fp64; tolerance 1e-10 relative (HF's
logged loss, a float32 value even for a float64 model, 1e-6).

The data leave a last window shorter than the rest, where two of the peers are not exact: Accelerate
and Lightning divide each micro-batch's mean by the configured accumulation count also in the last
window, so with ``j`` of ``k`` batches left its gradient is ``j/k`` of the mean of its samples (here
3/4); HF's Trainer counts the batches (and tokens) that remain, as autoaccum takes the exact mean.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import numpy as np
import pytest
import torch
from _audit import IdAudit
from _mlp_rows import mean_loss, mlp, samples

from autoaccum import emulated_budget, parse_bytes

pl = pytest.importorskip("lightning.pytorch")
accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from _token_rows import Rows, collate, gpt2, ids_of  # noqa: E402 - after the skips
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from autoaccum.integrations.accelerate import guard_for  # noqa: E402
from autoaccum.integrations.lightning import AutoAccum  # noqa: E402
from autoaccum.integrations.transformers import AutoAccumTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10


def grads_of(model: torch.nn.Module) -> list[np.ndarray]:
    """Copies of the gradients, made by numpy: outside an emulated budget's counter (a recording is no part of
    the run whose memory it emulates)."""
    return [np.zeros(tuple(p.shape)) if p.grad is None else p.grad.detach().numpy().copy() for p in model.parameters()]


def params_of(model: torch.nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def rel_diff(a: list, b: list) -> float:
    """``max |a - b| / max |b|`` over all arrays together (per array, a bias whose gradient is zero in exact
    arithmetic would compare rounding noise)."""
    assert len(a) == len(b)
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b)) / \
        max(float(np.abs(np.asarray(y)).max()) for y in b)


def per_step_rel_diff(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> list[float]:
    assert len(a) == len(b), (len(a), len(b))
    return [rel_diff(x, y) for x, y in zip(a, b)]


class Drop:
    """Lowers an emulated budget after a given optimizer step (a device whose free memory shrinks mid-run)."""

    def __init__(self, meter, after: int | None, lower: str | None) -> None:
        self.meter, self.after = meter, after
        self.lower = None if lower is None else parse_bytes(lower)

    def at(self, steps_done: int) -> None:
        if self.meter is not None and steps_done == self.after:
            self.meter.budget_bytes = self.lower


# == Lightning ==================================================================================================
# An MLP, a mean cross-entropy over 4 targets per sample, SGD with momentum and a per-step LambdaLR; no clipping
# (the last window's gradient is compared as a ratio). 60 samples: global batches of 16, the last of 12; Lightning's
# own accumulation runs batches of 4 in windows of 4, the last of 3.
L_N, L_GLOBAL, L_STEPS = 60, 16, 4
L_BUDGET, L_LOWER = "380KiB", "330KiB"  # micro-batches up to 5 fit, after the drop 2


@pytest.fixture(autouse=True)
def _quiet_frameworks():
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|LeafSpec|"
                                                  "loss_type=None|max_steps).*")
        yield


class LModule(pl.LightningModule):
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


class LRecord(pl.Callback):
    """Per optimizer step: the gradients Lightning is about to step on, the learning rate, the samples; per
    batch: the loss Lightning received from ``training_step``."""

    def __init__(self, drop: Drop) -> None:
        self.drop, self.grads, self.lrs, self.losses = drop, [], [], []

    def on_train_start(self, trainer, pl_module):
        pl_module.audit.watch(trainer.optimizers[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pl_module.audit.step()
        self.grads.append(grads_of(pl_module))
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.drop.at(trainer.global_step)


def lightning_run(*callbacks: pl.Callback, batch_size: int = L_GLOBAL, accumulate: int = 1, budget: str | None = None,
                  drop_after: int | None = None, n: int = L_N) -> dict:
    module = LModule()
    meter = emulated_budget(budget, module) if budget is not None else None
    record = LRecord(Drop(meter, drop_after, L_LOWER))
    run = pl.Trainer(callbacks=[*callbacks, record], accelerator="cpu", devices=1, max_epochs=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     accumulate_grad_batches=accumulate)
    calls = {"zero_grad": 0}
    zero_grad = torch.optim.SGD.zero_grad

    def counting(self, *args, **kwargs):  # as Lightning's zero-grad count test patches torch.optim.SGD.zero_grad
        calls["zero_grad"] += 1
        return zero_grad(self, *args, **kwargs)

    loader = torch.utils.data.DataLoader(samples()[:n], batch_size=batch_size)
    with pytest.MonkeyPatch.context() as patch, meter if meter is not None else contextlib.nullcontext():
        patch.setattr(torch.optim.SGD, "zero_grad", counting)
        run.fit(module, loader)
    return {"params": params_of(module), "grads": record.grads, "lrs": record.lrs, "losses": record.losses,
            "steps": module.audit.steps, "audit": module.audit.check(), "global_step": run.global_step,
            "scheduler_steps": run.lr_scheduler_configs[0].scheduler.last_epoch, "zero_grad": calls["zero_grad"]}


@pytest.fixture(scope="module")
def lightning_runs(one_thread) -> dict:
    """Lightning without accumulation (the reference), Lightning's own accumulation (4 x 4), and AutoAccum
    probing under the budget, which drops after step 2."""
    callback = AutoAccum()
    runs = {"reference": lightning_run(), "own": lightning_run(batch_size=4, accumulate=4),
            "autoaccum": lightning_run(callback, budget=L_BUDGET, drop_after=2)}
    runs["guard"] = callback.guard
    return runs


def test_lightning_under_the_budget_probes_a_small_micro_batch_and_replays_step_3(lightning_runs):
    lazy = lightning_runs["guard"]
    assert lazy.plan_source == "probe" and lazy.report.plan.micro_batch < L_GLOBAL and lazy.report.plan.accum_steps > 1
    guard = lazy.guard
    assert guard.ooms >= 1 and {(c.step, c.reason) for c in guard.changes} == {(3, "oom")}
    assert guard.plan.micro_batch < lazy.report.plan.micro_batch


def test_lightning_gradients_at_each_optimizer_step_equal_the_run_without_accumulation(lightning_runs):
    ref, got = lightning_runs["reference"], lightning_runs["autoaccum"]
    assert max(per_step_rel_diff(got["grads"], ref["grads"])) <= RTOL
    assert rel_diff(got["params"], ref["params"]) <= RTOL


def test_lightning_loss_per_step_and_learning_rate_per_step(lightning_runs):
    ref, got = lightning_runs["reference"], lightning_runs["autoaccum"]
    assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL)  # training_step's loss: the step's, exact
    assert got["lrs"] == ref["lrs"] and len(set(ref["lrs"])) == L_STEPS  # the schedule moved every step


def test_lightning_batch_step_and_zero_grad_counts(lightning_runs):
    """Lightning's own count test: ``zero_grad`` once per optimizer step (the probe calls none). The guard's
    replay after an OOM clears the failed attempt's gradients through ``zero_grad`` too: once more per replay."""
    ooms = lightning_runs["guard"].guard.ooms
    for name in ("reference", "own", "autoaccum"):
        run = lightning_runs[name]
        assert run["global_step"] == run["scheduler_steps"] == len(run["grads"]) == L_STEPS, name
        assert run["zero_grad"] == L_STEPS + (ooms if name == "autoaccum" else 0), name
        assert [len(s) for s in run["steps"]] == [16, 16, 16, 12], name
        assert run["audit"] == {"steps": L_STEPS, "repeated": 0, "inconsistent": 0}, name
    assert lightning_runs["autoaccum"]["steps"] == lightning_runs["reference"]["steps"]


def test_lightning_the_last_short_window_is_exact_where_lightning_divides_by_the_count(lightning_runs):
    """The last window: 3 batches of the 4 configured. Lightning's own accumulation steps on 3/4 of the mean
    gradient of those 12 samples (each batch's mean divided by 4); AutoAccum on the mean itself. The full
    windows before it agree (equal batch sizes, a per-sample mean)."""
    ref, own, got = lightning_runs["reference"], lightning_runs["own"], lightning_runs["autoaccum"]
    assert rel_diff(got["grads"][-1], ref["grads"][-1]) <= RTOL
    assert max(per_step_rel_diff(own["grads"][:-1], ref["grads"][:-1])) <= RTOL
    assert rel_diff(own["grads"][-1], [0.75 * g for g in ref["grads"][-1]]) <= RTOL  # (3 of 4 batches)
    assert rel_diff(own["grads"][-1], ref["grads"][-1]) > 0.2  # negative control: the comparison sees it


@pytest.mark.parametrize("accumulate, expected", [(1, 20), (2, 10), (3, 7)])
def test_lightning_zero_grad_count_with_a_probe_at_the_first_batch(accumulate, expected):
    """Lightning's own test: 20 batches, ``accumulate_grad_batches`` 1, 2, 3 -> ``zero_grad`` 20, 10, 7 times.
    The same windows as global batches under AutoAccum, planned by a probe at the first one:
    the same counts (the probe calls no ``zero_grad``). Negative control: Lightning's own accumulation run."""
    n = 20 * 2
    own = lightning_run(batch_size=2, accumulate=accumulate, n=n)
    callback = AutoAccum(budget="360KiB")
    got = lightning_run(callback, batch_size=2 * accumulate, n=n)
    assert callback.guard.plan_source == "probe"
    assert own["zero_grad"] == got["zero_grad"] == own["global_step"] == got["global_step"] == expected
    assert got["steps"] == own["steps"]


# == Accelerate =================================================================================================
# The MLP and rows of the Lightning block in an Accelerate loop (the one of examples/accelerate_loop.py): the
# reference is Accelerate's own loop, ``accelerator.backward`` of the whole batch; Accelerate's own accumulation
# runs batches of 4 under ``accelerator.accumulate`` with 4 steps.
A_BUDGET, A_LOWER = "380KiB", "330KiB"


@contextlib.contextmanager
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons (AcceleratorState, GradientState); each run starts anew."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def accelerate_loop(accelerator, rows: list[dict], *, guarded: bool, batch_size: int, budget: str | None = None,
                    drop_after: int | None = None, lower: str = A_LOWER, truth: bool = False) -> dict:
    """One epoch; at every sync point the gradients, the learning rate, the step's loss and samples. With
    ``truth`` (one process, no budget: its steps are no part of the emulated device), a ground-truth model, as
    Accelerate's test_sync keeps one, is stepped on the whole batch beside, its gradients recorded."""
    assert not (truth and (budget is not None or accelerator.num_processes > 1))
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    loader = torch.utils.data.DataLoader(rows, batch_size=batch_size)
    model, optimizer, loader, schedule = accelerator.prepare(net, optimizer, loader, schedule)
    ground = mlp() if truth else None
    ground_optimizer = torch.optim.SGD(ground.parameters(), lr=0.1, momentum=0.9) if truth else None
    ground_schedule = torch.optim.lr_scheduler.LambdaLR(ground_optimizer, lambda s: 1.0 / (1.0 + s)) if truth else None
    guard = guard_for(accelerator, model, optimizer) if guarded else None
    audit = IdAudit(model)
    audit.watch(optimizer)
    stepped = {"n": 0}
    optimizer.optimizer.register_step_post_hook(lambda *args: stepped.__setitem__("n", stepped["n"] + 1))
    meter = emulated_budget(budget, model) if budget is not None else None
    drop = Drop(meter, drop_after, lower)
    out: dict = {"grads": [], "truth": [], "lrs": [], "losses": [], "syncs": 0}
    window_loss = 0.0
    with meter if meter is not None else contextlib.nullcontext():
        for batch in loader:
            if guard is not None:
                audit.forward(batch["ids"].tolist())  # the guard's micro-batches reach the gradient; the audit
                result = guard.accumulate(batch, lambda m, b: mean_loss(m, b))  # names them by the whole batch
                window_loss = result.loss
            else:
                audit.forward(batch["ids"].tolist())
                with accelerator.accumulate(model):
                    loss = mean_loss(model, batch)
                    accelerator.backward(loss)
                    window_loss += float(loss.detach()) / accelerator.gradient_accumulation_steps
            if accelerator.sync_gradients:
                out["syncs"] += 1
                audit.step()
                out["grads"].append(grads_of(accelerator.unwrap_model(model)))
                out["lrs"].append(optimizer.param_groups[0]["lr"])
                out["losses"].append(window_loss)
                window_loss = 0.0
                if ground is not None:
                    ground_optimizer.zero_grad()
                    mean_loss(ground, batch).backward()
                    out["truth"].append(grads_of(ground))
                    ground_optimizer.step()
                    ground_schedule.step()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            drop.at(out["syncs"] if accelerator.sync_gradients else -1)
    out.update(params=params_of(accelerator.unwrap_model(model)), steps=audit.steps, audit=audit.check(),
               stepped=stepped["n"], scheduler_steps=schedule.scheduler.last_epoch,
               guard=None if guard is None else guard)
    return out


def accelerate_run(**kwargs) -> dict:
    with fresh_accelerate_state():
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=kwargs.pop("accumulate", 1))
        return accelerate_loop(accelerator, samples()[:L_N], **kwargs)


@pytest.fixture(scope="module")
def accelerate_runs(one_thread) -> dict:
    return {"reference": accelerate_run(guarded=False, batch_size=L_GLOBAL, truth=True),
            "own": accelerate_run(guarded=False, batch_size=4, accumulate=4),
            "autoaccum": accelerate_run(guarded=True, batch_size=L_GLOBAL, budget=A_BUDGET, drop_after=2)}


def test_accelerate_under_the_budget_probes_a_small_micro_batch_and_replays_step_3(accelerate_runs):
    lazy = accelerate_runs["autoaccum"]["guard"]
    assert lazy.plan_source == "probe" and lazy.report.plan.micro_batch < L_GLOBAL and lazy.report.plan.accum_steps > 1
    assert lazy.guard.ooms >= 1 and {(c.step, c.reason) for c in lazy.guard.changes} == {(3, "oom")}


def test_accelerate_gradients_at_each_sync_point_equal_the_ground_truth(accelerate_runs):
    """test_sync's check: at every sync point the gradients equal a model stepped on the whole batch."""
    ref, got = accelerate_runs["reference"], accelerate_runs["autoaccum"]
    assert max(per_step_rel_diff(ref["grads"], ref["truth"])) <= RTOL  # Accelerate's loop is the ground truth
    assert max(per_step_rel_diff(got["grads"], ref["truth"])) <= RTOL
    assert rel_diff(got["params"], ref["params"]) <= RTOL


def test_accelerate_learning_rate_loss_and_step_counts(accelerate_runs):
    ref, got = accelerate_runs["reference"], accelerate_runs["autoaccum"]
    assert got["lrs"] == ref["lrs"] and len(set(ref["lrs"])) == L_STEPS
    assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL)
    for name in ("reference", "own", "autoaccum"):
        run = accelerate_runs[name]
        assert run["syncs"] == run["stepped"] == run["scheduler_steps"] == L_STEPS, name  # steps only at syncs
        assert [len(s) for s in run["steps"]] == [16, 16, 16, 12], name
        assert run["audit"] == {"steps": L_STEPS, "repeated": 0, "inconsistent": 0}, name
    assert got["steps"] == ref["steps"]


def test_accelerate_the_last_short_window_is_exact_where_accelerate_divides_by_the_count(accelerate_runs):
    """The last window: 3 batches of the 4 configured; Accelerate syncs there (end of the dataloader) and
    steps on 3/4 of the mean gradient of its 12 samples (``accelerator.backward`` divides by 4)."""
    ref, own, got = accelerate_runs["reference"], accelerate_runs["own"], accelerate_runs["autoaccum"]
    assert rel_diff(got["grads"][-1], ref["grads"][-1]) <= RTOL
    assert max(per_step_rel_diff(own["grads"][:-1], ref["grads"][:-1])) <= RTOL
    assert rel_diff(own["grads"][-1], [0.75 * g for g in ref["grads"][-1]]) <= RTOL
    assert rel_diff(own["grads"][-1], ref["grads"][-1]) > 0.2  # negative control: the comparison sees it


A2_N, A2_GLOBAL = 124, 32  # a share of 16 per process (8 would leave the probe no smaller size worth taking)
A_DDP_BUDGET, A_DDP_LOWER = "480KiB", "420KiB"  # micro 8 planned; after the drop it no longer fits


def _accelerate_two_processes(rank: int, world_size: int, budget: str, lower: str) -> dict:
    """Each process: its share (16) of every global batch of 32 (``split_batches``; with ``even_batches=False``
    the last, of 28, is 16 and 12, not filled up with repeated samples). Rank 1 alone has its budget lowered
    after step 2."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")
    from accelerate.utils import DataLoaderConfiguration

    config = DataLoaderConfiguration(split_batches=True, even_batches=False)
    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=config)
    out = accelerate_loop(accelerator, samples(n=A2_N), guarded=True, batch_size=A2_GLOBAL, budget=budget,
                          drop_after=2 if rank == 1 else None, lower=lower)
    lazy = out.pop("guard")
    guard = lazy.guard
    out.update(plan=guard.plan.to_dict(), probed=lazy.report.plan.to_dict(),
               changes={(c.step, c.reason) for c in guard.changes}, wrapper=type(guard.model).__name__)
    return out


@pytest.mark.slow  # two spawned processes
def test_accelerate_on_two_processes_gradients_at_each_sync_point_equal_the_ground_truth(tmp_path):
    from _spawn import results, spawn

    ranks = results(tmp_path, spawn(_accelerate_two_processes, tmp_path, budget=A_DDP_BUDGET, lower=A_DDP_LOWER)[0])
    assert [r["wrapper"] for r in ranks] == ["DistributedDataParallel"] * 2
    assert ranks[0]["probed"]["micro_batch"] < A2_GLOBAL // 2 and ranks[0]["plan"]["world_size"] == 2
    assert [r["changes"] for r in ranks] == [{(3, "oom")}] * 2 and ranks[0]["plan"] == ranks[1]["plan"]
    for r in ranks:
        assert r["syncs"] == r["stepped"] == r["scheduler_steps"] == L_STEPS
    assert ranks[0]["lrs"] == ranks[1]["lrs"] and ranks[0]["losses"] == pytest.approx(ranks[1]["losses"], rel=RTOL)
    assert rel_diff(ranks[0]["params"], ranks[1]["params"]) == 0
    assert max(per_step_rel_diff(ranks[0]["grads"], ranks[1]["grads"])) == 0  # synced at every step
    batches = [sorted(a + b) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"])]
    assert [len(b) for b in batches] == [32, 32, 32, 28] and sorted(i for b in batches for i in b) == list(range(A2_N))
    # the ground truth: one process, Accelerate's own loop without accumulation, on those batches
    with fresh_accelerate_state():
        rows = samples(n=A2_N)
        ref = accelerate_loop(accelerate.Accelerator(cpu=True), [rows[i] for b in batches for i in b], guarded=False,
                              batch_size=A2_GLOBAL, truth=True)
    assert max(per_step_rel_diff(ranks[0]["grads"], ref["truth"])) <= RTOL  # every sync point, the last short one too
    assert ranks[0]["lrs"] == ref["lrs"] and ranks[0]["losses"] == pytest.approx(ref["losses"], rel=RTOL)
    assert rel_diff(ranks[0]["params"], ref["params"]) <= RTOL


# == Hugging Face Trainer =======================================================================================
# GPT-2 from a config on padded token rows (tests/_token_rows.py), HF's own token-level loss, AdamW, a linear
# schedule with warmup, clipping at 1.0, one epoch of 36 rows: global batches of 8, the last of 4. The reference is
# HF's Trainer at per-device 8 without accumulation; HF's own accumulation runs per-device 2 x 4.
H_N, H_GLOBAL, H_STEPS = 36, 8, 5
H_BUDGET, H_LOWER = "2MiB", "1.45MiB"  # micro-batches up to 3 fit, after the drop 1


class HRecord(TrainerCallback):
    """Per optimizer step: the gradients HF is about to step on (after its clipping), the learning rate, the
    samples; the budget drop."""

    def __init__(self, audit: IdAudit, drop: Drop) -> None:
        self.audit, self.drop, self.grads, self.lrs, self.steps = audit, drop, [], [], 0

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.audit.watch(optimizer)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.audit.step()
        self.grads.append(grads_of(model))
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.steps += 1

    def on_step_end(self, args, state, control, **kwargs):
        self.drop.at(state.global_step)


def hf_arguments(out: str, per_device: int, accum: int, **kwargs) -> TrainingArguments:
    options = dict(num_train_epochs=1, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
                   optim="adamw_torch", report_to="none", use_cpu=True, save_strategy="no", logging_steps=1,
                   disable_tqdm=True, seed=0, dataloader_num_workers=0)
    options.update(kwargs)
    return TrainingArguments(output_dir=out, per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=accum, **options)


def hf_run(trainer_cls, args: TrainingArguments, *, budget: str | None = None, drop_after: int | None = None,
           lower: str = H_LOWER, accepts_loss_kwargs: bool | None = None, train_dataset=None, **kwargs) -> dict:
    transformers.logging.set_verbosity_error()
    model = gpt2()
    audit = IdAudit(model)
    audit.hook_forward(model, ids_of)
    meter = emulated_budget(budget, model) if budget is not None else None
    record = HRecord(audit, Drop(meter, drop_after, lower))
    trainer = trainer_cls(model=model, args=args, train_dataset=train_dataset or Rows(H_N), data_collator=collate,
                          callbacks=[record], **kwargs)
    if accepts_loss_kwargs is not None:
        trainer.model_accepts_loss_kwargs = accepts_loss_kwargs
    calls = {"training_step": 0}
    training_step = trainer.training_step

    def counted(*a, **kw):
        calls["training_step"] += 1
        return training_step(*a, **kw)

    trainer.training_step = counted
    with meter if meter is not None else contextlib.nullcontext():
        trainer.train()
    history = trainer.state.log_history
    lazy = getattr(trainer, "autoaccum_guard", None)
    return {"params": params_of(model), "grads": record.grads, "lrs": record.lrs, "steps": audit.steps,
            "audit": audit.check(), "losses": [h["loss"] for h in history if "loss" in h],
            "norms": [h["grad_norm"] for h in history if "grad_norm" in h],
            "logged_lrs": [h["learning_rate"] for h in history if "learning_rate" in h],
            "optimizer_steps": record.steps, "global_step": trainer.state.global_step,
            "scheduler_steps": trainer.lr_scheduler.last_epoch, "training_step": calls["training_step"],
            "epoch": trainer.state.epoch, "guard": lazy}


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory, one_thread) -> dict:
    out = tmp_path_factory.mktemp("hf")
    return {"reference": hf_run(Trainer, hf_arguments(str(out / "ref"), H_GLOBAL, 1)),
            "own": hf_run(Trainer, hf_arguments(str(out / "own"), 2, 4)),
            "autoaccum": hf_run(AutoAccumTrainer, hf_arguments(str(out / "aa"), 2, 4), budget=H_BUDGET,
                                drop_after=2)}


def test_hf_under_the_budget_probes_a_small_micro_batch_and_replays_step_3(hf_runs):
    lazy = hf_runs["autoaccum"]["guard"]
    assert lazy.plan_source == "probe" and lazy.report.plan.micro_batch < H_GLOBAL and lazy.report.plan.accum_steps > 1
    assert lazy.guard.ooms >= 1 and {(c.step, c.reason) for c in lazy.guard.changes} == {(3, "oom")}


def test_hf_gradients_at_each_optimizer_step_equal_the_run_without_accumulation(hf_runs):
    """HF's gradient-accumulation tests compare the trained weights with and without accumulation; here also
    the gradients HF steps on, after its clipping, and the norm it logs (before clipping), step by step."""
    ref, own, got = hf_runs["reference"], hf_runs["own"], hf_runs["autoaccum"]
    assert max(per_step_rel_diff(got["grads"], ref["grads"])) <= RTOL
    assert got["norms"] == pytest.approx(ref["norms"], rel=RTOL)
    assert rel_diff(got["params"], ref["params"]) <= RTOL
    assert max(per_step_rel_diff(own["grads"], ref["grads"])) <= RTOL  # HF's own accumulation is exact here too


def test_hf_logged_loss_and_learning_rate_per_step(hf_runs):
    """HF's loss-alignment test: the loss logged at each step is the same with and without accumulation (a
    float32 value even for a float64 model: HF's cross-entropy runs on logits.float())."""
    ref, own, got = hf_runs["reference"], hf_runs["own"], hf_runs["autoaccum"]
    assert len(ref["losses"]) == H_STEPS
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert own["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert got["lrs"] == ref["lrs"] and got["logged_lrs"] == ref["logged_lrs"] and len(set(ref["lrs"])) > 1


def test_hf_batch_and_step_counts(hf_runs):
    for name in ("reference", "own", "autoaccum"):
        run = hf_runs[name]
        assert run["optimizer_steps"] == run["global_step"] == run["scheduler_steps"] == H_STEPS, name
        assert [len(s) for s in run["steps"]] == [8, 8, 8, 8, 4] and run["epoch"] == 1, name
        assert run["audit"] == {"steps": H_STEPS, "repeated": 0, "inconsistent": 0}, name
        assert sorted(i for s in run["steps"] for i in s) == list(range(H_N)), name
    assert hf_runs["own"]["steps"] == hf_runs["autoaccum"]["steps"] == hf_runs["reference"]["steps"]
    # HF calls training_step once per batch it loads: 18 of 2 with its own accumulation, 5 global batches here
    assert [hf_runs[n]["training_step"] for n in ("reference", "own", "autoaccum")] == [5, 18, 5]


def test_hf_the_last_short_window_is_exact(hf_runs):
    """The last step holds 4 samples. HF counts what remains (2 batches, and their tokens), as autoaccum takes
    the exact mean: both equal the run without accumulation there."""
    ref, own, got = hf_runs["reference"], hf_runs["own"], hf_runs["autoaccum"]
    assert rel_diff(got["grads"][-1], ref["grads"][-1]) <= RTOL
    assert rel_diff(own["grads"][-1], ref["grads"][-1]) <= RTOL


def test_hf_negative_control_a_mean_of_micro_batch_means_differs_at_the_sync_points(hf_runs, tmp_path):
    """HF's own accumulation where it passes no token count (the model taken for one whose forward takes no loss
    keyword arguments): each micro-batch's token mean over 4. The comparison of the sync points sees it."""
    broken = hf_run(Trainer, hf_arguments(str(tmp_path), 2, 4), accepts_loss_kwargs=False)
    assert min(per_step_rel_diff(broken["grads"], hf_runs["reference"]["grads"])) > 1e-6


def _hf_two_processes(rank: int, world_size: int, out: str, budget: str, lower: str) -> dict:
    """AutoAccumTrainer on two processes (the harness made the process group; Accelerate takes it): per device
    2 x accumulation 2, 8 samples per step; rank 1 alone has its budget lowered after step 2."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")
    # even_batches=False: the last batch (2 rows, on process 1) is not filled up with rows from the epoch's start;
    # 30 rows make 8 loader batches of 4, as many for each process
    args = hf_arguments(out, 2, 2, ddp_backend="gloo", accelerator_config={"even_batches": False})
    # no memory saver: the scenario is the plain replay (with checkpointing the probe plans the whole share of 4)
    run = hf_run(AutoAccumTrainer, args, budget=budget, drop_after=2 if rank == 1 else None, lower=lower,
                 headroom=0.2, train_dataset=Rows(H2_N), memory_savers="off")
    lazy = run.pop("guard")
    run.update(plan=lazy.guard.plan.to_dict(), probed=lazy.report.plan.to_dict(),
               changes={(c.step, c.reason) for c in lazy.guard.changes})
    return run


# DDP's buckets and the guard's all-reduce buffer are allocated at the first step, after the probe planned: the
# probe keeps a headroom of 0.2 for them (micro 3 over it, 2 planned); after the drop 2 no longer fits
H_DDP_BUDGET, H_DDP_LOWER = "2MiB", "1.7MiB"
H2_N = 30  # global batches of 8: 8, 8, 8, 6


@pytest.mark.slow  # two spawned processes, each importing transformers
def test_hf_on_two_processes_each_step_equals_one_process_without_accumulation(tmp_path):
    from _spawn import results, spawn

    ranks = results(tmp_path, spawn(_hf_two_processes, tmp_path, out=str(tmp_path / "out"), budget=H_DDP_BUDGET,
                                    lower=H_DDP_LOWER)[0])
    assert ranks[0]["probed"]["micro_batch"] < 4 and ranks[0]["plan"]["world_size"] == 2  # a share of 4 per rank
    assert [r["changes"] for r in ranks] == [{(3, "oom")}] * 2 and ranks[0]["plan"] == ranks[1]["plan"]
    for r in ranks:
        assert r["optimizer_steps"] == r["global_step"] == r["scheduler_steps"] == 4
    assert max(per_step_rel_diff(ranks[0]["grads"], ranks[1]["grads"])) == 0
    batches = [sorted(a + b) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"])]
    assert [len(b) for b in batches] == [8, 8, 8, 6] and sorted(i for b in batches for i in b) == list(range(H2_N))

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return [i for b in batches for i in b]

    ref = hf_run(InOrder, hf_arguments(str(tmp_path / "ref"), H_GLOBAL, 1), train_dataset=Rows(H2_N))
    assert ref["steps"] == batches
    assert max(per_step_rel_diff(ranks[0]["grads"], ref["grads"])) <= RTOL
    assert ranks[0]["losses"] == pytest.approx(ref["losses"], rel=1e-6) and ranks[0]["lrs"] == ref["lrs"]
    assert rel_diff(ranks[0]["params"], ref["params"]) <= RTOL
