"""``AutoAccumTrainer`` (autoaccum.integrations.transformers) against Hugging Face's own full-batch run.

The reference is HF's ``Trainer`` itself with ``per_device_train_batch_size`` = the global batch and
``gradient_accumulation_steps=1``, on the same samples in the same order (HF's seeded sampler); the
AutoAccumTrainer gets the arguments a user writes (per device 2 x accumulation 4). fp64, dropout off,
HF's clipping (max_grad_norm 1.0), a linear schedule with warmup, AdamW. GPT-2 on padded sequences of
3..16 tokens: a token-level loss, where a mean of micro-batch means would differ (negative control).
Sample ids ride in the first token (``input_ids[:, 0] = 2 + id``) and are audited per optimizer step.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from _audit import IdAudit

from autoaccum import emulated_budget, parse_bytes

transformers = pytest.importorskip("transformers")
from _token_rows import N, Rows, bert, collate, gpt2, ids_of, llama  # noqa: E402
from helpers import params, rel_diff  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402 - after the skip

from autoaccum.integrations.transformers import GUARD_FILE, AutoAccumTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10
PER_DEVICE, ACCUM, STEPS = 2, 4, 4  # global batch 8; 4 optimizer steps = one epoch of 32 samples
BUDGET = "2MiB"  # micro-batches up to 3 fit: the plan accumulates
LOWER = "1.45MiB"  # after step 2: micro 3 no longer fits, 1 does


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()
    yield


def arguments(out: str, per_device: int, accum: int, **kw) -> TrainingArguments:
    options = dict(max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
                   optim="adamw_torch", report_to="none", use_cpu=True, save_strategy="no", logging_steps=1,
                   disable_tqdm=True, seed=0, dataloader_num_workers=0)
    options.update(kw)
    return TrainingArguments(output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=accum,
                             **options)


class Watch(TrainerCallback):
    """The audit's step before HF's optimizer step; optimizer steps counted; optionally a budget drop."""

    def __init__(self, audit: IdAudit, drop: tuple[int, object, int] | None = None) -> None:
        self.audit, self.drop, self.optimizer_steps = audit, drop, 0

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.audit.watch(optimizer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.audit.step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.optimizer_steps += 1

    def on_step_end(self, args, state, control, **kwargs):
        if self.drop is not None and state.global_step == self.drop[0]:
            self.drop[1].budget_bytes = self.drop[2]


def train(trainer_cls, model, args, *, data=None, budget=None, drop_after=None, per_sample=False, resume=None,
          callbacks=(), **kwargs):
    audit = IdAudit(model)
    audit.hook_forward(model, ids_of)
    meter = emulated_budget(budget, model) if budget is not None else None
    watch = Watch(audit, None if drop_after is None else (drop_after, meter, parse_bytes(LOWER)))
    trainer = trainer_cls(model=model, args=args, train_dataset=data or Rows(), callbacks=[watch, *callbacks],
                          data_collator=lambda rows: collate(rows, per_sample), **kwargs)
    if meter is None:
        trainer.train(resume_from_checkpoint=resume)
    else:
        with meter:
            trainer.train(resume_from_checkpoint=resume)
    return trainer, audit, watch


@pytest.fixture(scope="module")
def reference(tmp_path_factory, one_thread):
    """HF's own full-batch run: per device 8, no accumulation."""
    transformers.logging.set_verbosity_error()
    model = gpt2()
    trainer, audit, _ = train(Trainer, model, arguments(str(tmp_path_factory.mktemp("ref")), 8, 1))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return {"params": params(model), "steps": audit.steps, "losses": losses, "norms": norms}


def test_under_a_budget_that_forces_accumulation_it_equals_hfs_full_batch_run(reference, tmp_path, caplog):
    model = gpt2()
    with caplog.at_level(logging.INFO, logger="autoaccum"):
        trainer, audit, watch = train(AutoAccumTrainer, model, arguments(str(tmp_path), PER_DEVICE, ACCUM),
                                      budget=BUDGET)
    plan = trainer.autoaccum_guard.guard.plan
    # the plan on the console once, as fit's banner (not only in the log dictionary), adding up
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name.startswith("autoaccum")]
    assert said == [f"autoaccum · {plan.describe()}, measured by the probe: micro-batches of up to "
                    f"{trainer.autoaccum_guard.report.max_fitting_micro_batch} fit in " + said[0].split(" fit in ")[1]]
    assert said[0].startswith("autoaccum · batch 8 = ") and "token-units" not in said[0]
    assert trainer.autoaccum_guard.plan_source == "probe"
    assert plan.target_batch == PER_DEVICE * ACCUM and plan.accum_steps > 1  # the budget forces accumulation
    assert rel_diff(params(model), reference["params"]) <= RTOL
    assert audit.steps == reference["steps"] and len(audit.steps) == STEPS  # the same samples in the same order
    assert audit.check() == {"steps": STEPS, "repeated": 0, "inconsistent": 0}
    assert sorted(i for s in audit.steps for i in s) == list(range(N))  # one epoch: each sample once
    # HF's own clipping, schedule and logging ran on the exact gradient
    history = trainer.state.log_history
    # (HF's loss is a float32 value even for a float64 model -- its cross-entropy runs on logits.float();
    # the step's loss here is the float64 sum of the micro-batches' float32 shares)
    assert [h["loss"] for h in history if "loss" in h] == pytest.approx(reference["losses"], rel=1e-6)
    assert [h["grad_norm"] for h in history if "grad_norm" in h] == pytest.approx(reference["norms"], rel=1e-10)
    assert trainer.state.global_step == watch.optimizer_steps == trainer.lr_scheduler.last_epoch == STEPS
    # the plan is in HF's log history; the caller's arguments are untouched
    assert history[0]["autoaccum/micro_batch"] == plan.micro_batch
    assert history[0]["autoaccum/accum_steps"] == plan.accum_steps
    assert trainer.autoaccum_args.gradient_accumulation_steps == ACCUM and trainer.args.gradient_accumulation_steps == 1


def test_the_budget_dropped_mid_run_is_recovered_in_place(reference, tmp_path, caplog):
    model = gpt2()
    with caplog.at_level(logging.WARNING, logger="autoaccum"):
        trainer, audit, watch = train(AutoAccumTrainer, model, arguments(str(tmp_path), PER_DEVICE, ACCUM),
                                      budget=BUDGET, drop_after=2, micro_batch=3)
    guard = trainer.autoaccum_guard.guard
    assert guard.ooms >= 1 and guard.plan.micro_batch < 3  # step 3 ran out of memory and was replayed smaller
    assert all(c.step == 3 and c.reason == "oom" for c in guard.changes)
    assert "batch 8 = " in caplog.text and "; the global batch is unchanged" in caplog.text
    changes = [h for h in trainer.state.log_history if "autoaccum/micro_batch" in h]
    assert [h["autoaccum/micro_batch"] for h in changes] == [3, guard.plan.micro_batch]
    assert changes[1]["step"] == 2 and changes[1]["autoaccum/oom_replays"] == guard.ooms  # logged at the change
    # nothing repeated or lost, every step the same samples as the full-batch run, the same result
    assert audit.steps == reference["steps"] and audit.check() == {"steps": STEPS, "repeated": 0, "inconsistent": 0}
    assert rel_diff(params(model), reference["params"]) <= RTOL
    assert trainer.state.global_step == watch.optimizer_steps == trainer.lr_scheduler.last_epoch == STEPS


def test_checkpoint_and_resume_keep_working_and_keep_the_plan(reference, tmp_path):
    args = arguments(str(tmp_path), PER_DEVICE, ACCUM, save_strategy="steps", save_steps=2)
    train(AutoAccumTrainer, gpt2(), args, micro_batch=3)
    saved = json.loads((tmp_path / "checkpoint-2" / GUARD_FILE).read_text())
    assert saved["plan"]["micro_batch"] == 3 and saved["steps"] == 2
    model = gpt2()  # a new process would start from scratch: HF loads weights, optimizer, scheduler, RNG
    trainer, audit, _ = train(AutoAccumTrainer, model, args, resume=str(tmp_path / "checkpoint-2"))
    assert trainer.autoaccum_guard.plan_source == "checkpoint"  # no probe: the plan came with the checkpoint
    assert trainer.autoaccum_guard.guard.plan.micro_batch == 3
    assert audit.steps == reference["steps"][2:]  # HF skipped the trained batches
    assert rel_diff(params(model), reference["params"]) <= RTOL
    assert trainer.state.global_step == trainer.lr_scheduler.last_epoch == STEPS


def test_negative_control_hfs_accumulation_as_a_mean_of_micro_batch_means_differs(reference, tmp_path):
    """HF's own accumulation where the token-count path is off (a model whose forward takes no loss
    keyword arguments): each micro-batch's token mean divided by the accumulation steps. On padded
    rows the micro-batches hold different token counts, so it is not the full-batch step."""
    model = gpt2()
    audit = IdAudit(model)
    trainer = Trainer(model=model, args=arguments(str(tmp_path), PER_DEVICE, ACCUM), train_dataset=Rows(),
                      data_collator=collate, callbacks=[Watch(audit)])
    trainer.model_accepts_loss_kwargs = False  # as for such a model
    trainer.train()
    assert rel_diff(params(model), reference["params"]) > 1e-6


def test_per_sample_labels_are_weighted_by_samples_where_hfs_count_path_would_sum_means(tmp_path):
    """BertForSequenceClassification takes loss keyword arguments, so HF counts items and passes the
    count, which its loss ignores: HF's own accumulation then sums micro-batch means (4x the gradient
    here). AutoAccumTrainer weights per-sample means by samples: equal to the full-batch run."""
    ref = bert()
    train(Trainer, ref, arguments(str(tmp_path / "ref"), 8, 1), per_sample=True)
    model = bert()
    trainer, _, _ = train(AutoAccumTrainer, model, arguments(str(tmp_path / "aa"), PER_DEVICE, ACCUM),
                          per_sample=True, micro_batch=3)
    assert trainer.autoaccum_guard.guard.plan.accum_steps == 3
    assert rel_diff(params(model), params(ref)) <= RTOL
    hf = bert()
    train(Trainer, hf, arguments(str(tmp_path / "hf"), PER_DEVICE, ACCUM), per_sample=True)
    assert rel_diff(params(hf), params(ref)) > 1e-6  # HF's own accumulation, for contrast


def test_what_it_cannot_run_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"auto_find_batch_size=True: it shrinks the batch.*Drop it"):
        AutoAccumTrainer(model=gpt2(), args=arguments(str(tmp_path), 2, 4, auto_find_batch_size=True))


@pytest.mark.parametrize("engine", ["is_deepspeed_enabled", "is_fsdp_enabled"])
def test_a_sharding_engine_is_refused_naming_what_works(tmp_path, engine):
    """HF's Trainer builds DeepSpeed or FSDP only where they run (not on one CPU process: "Using fsdp only works in
    distributed training"), so the trainer's flag is set as a launched run sets it and the check run again: the
    message names FSDP2 under torchrun. Control: the check passes as built."""
    trainer = AutoAccumTrainer(model=gpt2(), args=arguments(str(tmp_path), PER_DEVICE, ACCUM), train_dataset=Rows())
    trainer._check_setup()
    setattr(trainer, engine, True)
    with pytest.raises(ValueError, match=r"AutoAccumTrainer does not support (DeepSpeed|FSDP) .*fully_shard under "
                                         r"torchrun.*DistributedSync\(model\)"):
        trainer._check_setup()


@pytest.mark.parametrize(("options", "error", "says"), [
    ({"plan": {"micro_batch": 4, "accum_steps": 2, "world_size": 1, "target_batch": 8}, "micro_batch": 3}, TypeError,
     r"give plan= or micro_batch=, not both"),
    ({"headroom": 1.5}, ValueError, r"Invalid headroom: 1.5\. Allowed range: 0 <= headroom < 1"),
    ({"budgett": "2MiB"}, TypeError, r"AutoAccumTrainer got an unknown option 'budgett'; did you mean 'budget'\?"),
    ({"data_colator": None}, TypeError, r"unknown option 'data_colator'; did you mean 'data_collator'\?"),
    ({"micro_batch": 0}, ValueError, r"Invalid micro_batch: 0"),
    ({"grow_after": 0}, ValueError, r"Invalid grow_after: 0"),
    ({"budget": "-1GiB"}, ValueError, r"Invalid budget '-1GiB': must be at least 1 byte\. Allowed range"),
    ({"plan": "no/such/plan.json"}, ValueError, r"Invalid plan file 'no/such/plan.json'"),
    ({"plan": {"plan": {"micro_batch": 4, "accum_steps": 2, "world_size": 1, "target_batch": 8},
               "model_fingerprint": "0" * 64, "model_summary": "MLP: 10 parameters (10 trainable), float32"}},
     ValueError, r"plan= is a probe report measured on another model \(MLP: 10 parameters .*\) than the one training "
     r"\(GPT2LMHeadModel: "),
])
def test_options_are_checked_when_the_trainer_is_built(tmp_path, options, error, says):
    """Not at train(): a mistake in autoaccum's options costs nothing but the construction."""
    with pytest.raises(error, match=says):
        AutoAccumTrainer(model=gpt2(), args=arguments(str(tmp_path), PER_DEVICE, ACCUM), train_dataset=Rows(),
                         **options)


def test_a_padding_free_collator_is_cut_between_whole_examples(tmp_path):
    """DataCollatorWithFlattening puts a whole batch in one row (the rows' tokens, position ids restarting at
    each): the micro-batches are whole examples, each collated by it. Equal to HF's full-batch run in fp64."""
    from transformers import DataCollatorWithFlattening

    rows = [{"input_ids": r["input_ids"].tolist()} for r in Rows()]

    def run(trainer_cls, per_device, accum, **kwargs):
        model = llama()
        trainer = trainer_cls(model=model, args=arguments(str(tmp_path / trainer_cls.__name__), per_device, accum),
                              train_dataset=rows, data_collator=DataCollatorWithFlattening(), **kwargs)
        trainer.train()
        return model, trainer

    reference, _ = run(Trainer, 8, 1)
    model, trainer = run(AutoAccumTrainer, PER_DEVICE, ACCUM, micro_batch=3)
    assert trainer.autoaccum_guard.guard.plan.accum_steps == 3
    assert rel_diff(params(model), params(reference)) <= RTOL


class _AccumulateFrom(TrainerCallback):
    """A callback that sets ``args.gradient_accumulation_steps`` (HF's inner loop reads it every step)."""

    def __init__(self, step: int, value: int) -> None:
        self.step, self.value = step, value

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            args.gradient_accumulation_steps = self.value


def test_gradient_accumulation_steps_changed_during_the_run_is_refused_at_the_next_step(tmp_path):
    """HF would then call training_step twice per optimizer step, each from the gradients the guard cleared: the
    last global batch's alone. Refused at step 3. Negative control: set to 1 (unchanged), the run completes."""
    args = arguments(str(tmp_path), PER_DEVICE, ACCUM)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps became 2 at step 2; it must stay 1"):
        train(AutoAccumTrainer, gpt2(), args, micro_batch=3, callbacks=[_AccumulateFrom(2, 2)])
    trainer, _, _ = train(AutoAccumTrainer, gpt2(), args, micro_batch=3, callbacks=[_AccumulateFrom(2, 1)])
    assert trainer.state.global_step == STEPS


# -- a model whose forward takes no loss keyword arguments: its own token mean, reweighted by tokens -----------
class OwnMeanLM(torch.nn.Module):
    """What many custom models are: ``forward(input_ids, labels=None)`` returning the mean cross-entropy
    over the labels other than -100 (shifted by one when ``shift``). HF sees no ``**kwargs``
    (``model_accepts_loss_kwargs=False``) and passes it no token count. fp64."""

    def __init__(self, shift: bool, min_rows: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(16, 8).double(), torch.nn.Linear(8, 16).double()
        self.shift, self.min_rows = shift, min_rows

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        if input_ids.shape[0] < self.min_rows:
            raise ValueError(f"this model needs at least {self.min_rows} rows")
        logits = self.out(torch.tanh(self.emb(input_ids)))
        if labels is None:
            return {"logits": logits}
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return {"loss": torch.nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1)), "logits": logits}


_OWN_ROWS = [{"input_ids": torch.arange(1, n + 1) % 15 + 1} for n in (1, 2, 6, 6)]  # 1, 2, 6 and 6 tokens


def _own_collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    longest = max(len(r["input_ids"]) for r in rows)
    ids, labels = torch.zeros(len(rows), longest, dtype=torch.long), torch.full((len(rows), longest), -100)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = labels[i, :len(r["input_ids"])] = r["input_ids"]
    return {"input_ids": ids, "labels": labels}


def _own_mean_step(trainer_cls, model, out: str, per_device: int, accum: int, **kwargs):
    """One SGD step at lr 1 on the four rows in order, no clipping."""
    class InOrder(trainer_cls):
        def _get_train_sampler(self, *args, **kw):
            return torch.utils.data.SequentialSampler(_OWN_ROWS)

    args = arguments(out, per_device, accum, max_steps=1, learning_rate=1.0, lr_scheduler_type="constant",
                     optim="sgd", max_grad_norm=0.0, warmup_steps=0)
    trainer = InOrder(model=model, args=args, train_dataset=_OWN_ROWS, data_collator=_own_collate, **kwargs)
    trainer.train()
    return trainer


@pytest.mark.parametrize("shift", [False, True], ids=["unshifted", "shifted"])
def test_a_models_own_token_mean_is_reweighted_by_its_token_share(shift, tmp_path, monkeypatch):
    """Trainer at per-device 4 (one forward of the 4 rows) against AutoAccumTrainer 2 x 2 cut at micro 1:
    equal in fp64. Negative controls: weighting each micro-batch's token mean by samples (no count), and
    the wrong verdict on the shift, both differ by more than 1e-3."""
    from autoaccum.integrations import hf_loss

    reference = OwnMeanLM(shift)
    _own_mean_step(Trainer, reference, str(tmp_path / "ref"), 4, 1)
    model = OwnMeanLM(shift)
    trainer = _own_mean_step(AutoAccumTrainer, model, str(tmp_path / "aa"), 2, 2, micro_batch=1)
    assert trainer.model_accepts_loss_kwargs is False and trainer.autoaccum_guard.guard.plan.accum_steps == 4
    assert rel_diff(params(model), params(reference)) <= RTOL
    assert trainer._autoaccum_loss.own_mean_shifts is shift  # asked of the model, not assumed
    by_samples = OwnMeanLM(shift)
    with monkeypatch.context() as patch:
        patch.setattr(hf_loss.TrainerLoss, "count_items", lambda self, model, batch: None)
        _own_mean_step(AutoAccumTrainer, by_samples, str(tmp_path / "samples"), 2, 2, micro_batch=1)
    assert rel_diff(params(by_samples), params(reference)) > 1e-3
    wrong = OwnMeanLM(shift)
    with monkeypatch.context() as patch:
        patch.setattr(hf_loss.TrainerLoss, "_ask_model", lambda self, model, batch, row: not shift)
        _own_mean_step(AutoAccumTrainer, wrong, str(tmp_path / "wrong"), 2, 2, micro_batch=1)
    assert rel_diff(params(wrong), params(reference)) > 1e-3


def test_where_the_models_own_mean_cannot_be_asked_it_warns_and_weights_by_samples(tmp_path):
    model = OwnMeanLM(shift=True, min_rows=2)  # refuses the one-row question
    with pytest.warns(UserWarning, match=r"cannot tell which labels the loss of OwnMeanLM averages over.*"
                                         r"weighted by samples.*num_items_in_batch, or pass compute_loss_func"):
        trainer = _own_mean_step(AutoAccumTrainer, model, str(tmp_path), 2, 2, micro_batch=2)
    assert trainer._autoaccum_loss.own_mean_shifts is None and trainer.state.global_step == 1


# -- two processes (gloo): DDP, HF's token count over all ranks ------------------------------------------------
def _two_process_train(rank: int, world_size: int, out: str) -> dict:
    """The AutoAccumTrainer on two processes (as torchrun starts them; the harness made the process group
    and Accelerate takes it): per device 2 x accumulation 2, so 8 samples per optimizer step. HF multiplies
    each loss by the number of processes (``average_tokens_across_devices``) for DDP's averaging; the guard
    sums gradients, so that factor must come out again. Rank 1 alone runs out of memory in step 3."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")
    transformers.logging.set_verbosity_error()
    model = gpt2()
    audit = IdAudit(model)
    audit.hook_forward(model, ids_of)
    oom = {"armed": None}

    def out_of_memory(module: torch.nn.Module, args: tuple) -> None:
        if oom["armed"] is not None:
            oom["armed"] -= 1
            if oom["armed"] == 0:
                oom["armed"] = None
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (injected by the test)")

    class Arm(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            oom["armed"] = 2 if state.global_step == 2 and rank == 1 else None

    model.transformer.register_forward_pre_hook(out_of_memory)
    trainer = AutoAccumTrainer(model=model, args=arguments(out, 2, 2, ddp_backend="gloo"), train_dataset=Rows(),
                               data_collator=collate, callbacks=[Watch(audit), Arm()], micro_batch=2)
    trainer.train()
    guard = trainer.autoaccum_guard.guard
    return {"params": params(model), "steps": audit.steps, "wrapper": type(trainer.model_wrapped).__name__,
            "changes": [(c.step, c.reason) for c in guard.changes], "plan": guard.plan.to_dict(),
            "global_step": trainer.state.global_step}


@pytest.mark.slow  # two spawned processes, each importing its framework
def test_two_processes_hfs_token_count_over_all_ranks_equals_one_process_full_batch(tmp_path):
    from test_distributed import results, spawn

    ranks = results(tmp_path, spawn(_two_process_train, tmp_path, out=str(tmp_path / "out"))[0])
    assert [r["wrapper"] for r in ranks] == ["DistributedDataParallel"] * 2 and ranks[0]["plan"]["world_size"] == 2
    assert [r["changes"] for r in ranks] == [[(3, "oom")]] * 2 and [r["global_step"] for r in ranks] == [STEPS] * 2
    assert all(torch.equal(a, ranks[1]["params"][n]) for n, a in ranks[0]["params"].items())
    batches = [sorted(a + b) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"])]
    assert [len(b) for b in batches] == [8] * STEPS and sorted(i for b in batches for i in b) == list(range(N))

    class Order(torch.utils.data.Sampler):
        def __iter__(self):
            return iter([i for b in batches for i in b])

        def __len__(self):
            return N

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return Order()

    model = gpt2()  # HF's own run in one process, one forward/backward per global batch of those samples
    InOrder(model=model, args=arguments(str(tmp_path / "ref"), 8, 1), train_dataset=Rows(),
            data_collator=collate).train()
    assert rel_diff(ranks[0]["params"], params(model)) <= RTOL
