"""``class SFT(SFTTrainer, AutoAccumTrainer)``: TRL's SFTTrainer with autoaccum's accumulation, against
SFTTrainer's own accumulation on the same arguments.

A tiny Llama (fp64) and a word-level tokenizer built in memory; plain text, prompt-completion
(completion-only loss), conversations (assistant-only loss) and packed text (TRL's default "bfd"
packing: padding-free, a whole batch in one row). The user's arguments: per device 2 x accumulation 4.
autoaccum probes under an emulated budget (it plans micro-batches of 3 or 4), and the budget drops after
step 2, so step 3 runs out of memory and is replayed smaller.

Tolerance: TRL computes log-probabilities in float32 (its fused LM head, ``trl.kernels.chunked_logprob``)
even for a float64 model, so SFTTrainer's own accumulation and its own full-batch run already differ by
~1e-8 (relative to the largest weight) after 5 steps. autoaccum is held to 1e-7 of SFTTrainer's own
accumulation; a wrong weighting (each micro-batch's token mean weighted by samples, the negative
control) is off by about 2e-2.
"""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
from _sft_data import KINDS, config_options, dataset, llama, tokenizer  # noqa: E402
from helpers import params, rel_diff  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from autoaccum import emulated_budget, parse_bytes  # noqa: E402
from autoaccum.integrations.transformers import AutoAccumTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, PER_DEVICE, ACCUM = 5, 2, 4
RTOL = 1e-7
#: the emulated budget the probe plans for (micro-batches of 3 or 4 fit), and the one after step 2 (1 or 2 fit)
BUDGETS = {"text": ("4.5MiB", "2.6MiB"), "completion": ("4.5MiB", "2.6MiB"), "chat": ("5.5MiB", "3MiB"),
           "packed": ("6.5MiB", "3.3MiB")}
STEP_KEYS = {"loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "num_tokens"}


class SFT(SFTTrainer, AutoAccumTrainer):
    """The documented form: the framework's trainer first, autoaccum's options taken as keywords."""


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    yield


def arguments(out, kind: str, **kw) -> SFTConfig:
    options = dict(max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
                   optim="adamw_torch", report_to="none", use_cpu=True, save_strategy="no", logging_steps=1,
                   disable_tqdm=True, seed=0, dataloader_num_workers=0, **config_options(kind))
    options.update(kw)
    return SFTConfig(output_dir=str(out), per_device_train_batch_size=PER_DEVICE,
                     gradient_accumulation_steps=ACCUM, **options)


class _Drop(TrainerCallback):
    """Lowers the emulated budget after step 2."""

    def __init__(self, meter, budget):
        self.meter, self.budget = meter, parse_bytes(budget)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.meter.budget_bytes = self.budget


def _train(trainer_cls, kind, out, *, budgets=None, **kwargs):
    model = llama()
    args = arguments(out, kind)
    if budgets is None:
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset(kind), processing_class=tokenizer(),
                              **kwargs)
        trainer.train()
        return model, trainer
    with emulated_budget(budgets[0], model) as meter:
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset(kind), processing_class=tokenizer(),
                              callbacks=[_Drop(meter, budgets[1])], **kwargs)
        trainer.train()
    return model, trainer


def _steps(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module", params=KINDS)
def reference(request, tmp_path_factory, one_thread):
    """SFTTrainer's own run: per device 2 x accumulation 4."""
    kind = request.param
    model, trainer = _train(SFTTrainer, kind, tmp_path_factory.mktemp(f"ref-{kind}"))
    return kind, params(model), _steps(trainer)


def test_equals_sfts_own_accumulation_through_a_probe_and_an_oom_replay(reference, tmp_path):
    kind, ref_params, ref_steps = reference
    model, trainer = _train(SFT, kind, tmp_path, budgets=BUDGETS[kind])
    lazy = trainer.autoaccum_guard
    guard = lazy.guard
    assert lazy.plan_source == "probe" and lazy.report.plan.micro_batch in (3, 4)  # the budget forced accumulation
    assert guard.ooms >= 1 and {(c.step, c.reason) for c in guard.changes} == {(3, "oom")}
    assert guard.plan.micro_batch < lazy.report.plan.micro_batch
    assert rel_diff(params(model), ref_params) <= RTOL
    steps = _steps(trainer)
    assert [h["step"] for h in steps] == list(range(1, STEPS + 1))
    assert [h["loss"] for h in steps] == pytest.approx([h["loss"] for h in ref_steps], rel=1e-6)
    # TRL's own metrics in each step's own entry; num_tokens as without autoaccum (the probe's passes and
    # the attempt that ran out of memory went through compute_loss too, and count nothing)
    assert all(STEP_KEYS <= set(h) for h in steps)
    assert [h["num_tokens"] for h in steps] == [h["num_tokens"] for h in ref_steps]
    plans = [h for h in trainer.state.log_history if "autoaccum/micro_batch" in h]
    assert [h["autoaccum/micro_batch"] for h in plans] == [lazy.report.plan.micro_batch, guard.plan.micro_batch]
    assert all(set(h) == {"autoaccum/micro_batch", "autoaccum/accum_steps", "autoaccum/oom_replays", "epoch", "step"}
               for h in plans)  # an entry of its own: none of TRL's per-step metrics absorbed


def test_negative_control_micro_batch_means_weighted_by_samples_differ(tmp_path, monkeypatch):
    from autoaccum.integrations import hf_loss

    ref, _ = _train(SFTTrainer, "text", tmp_path / "ref")
    monkeypatch.setattr(hf_loss.TrainerLoss, "count_items", lambda self, model, batch: None)
    model, trainer = _train(SFT, "text", tmp_path / "wrong", micro_batch=3)
    assert trainer.autoaccum_guard.guard.plan.accum_steps == 3
    assert rel_diff(params(model), params(ref)) > 1e-3


def test_sfts_training_step_runs_around_autoaccums(tmp_path):
    """TRL's training_step enters its activation-offload context and calls super(): autoaccum's step, and
    every forward of it (the probe's too), runs inside."""
    inside, seen = [False], []

    @contextlib.contextmanager
    def offload():
        inside[0] = True
        yield
        inside[0] = False

    class Recorder:  # SFTTrainer enters the same object every step
        def __enter__(self):
            self.cm = offload()
            return self.cm.__enter__()

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

    model = llama()
    model.register_forward_pre_hook(lambda module, args: seen.append(inside[0]))
    trainer = SFT(model=model, args=arguments(tmp_path, "text", max_steps=2), train_dataset=dataset("text"),
                  processing_class=tokenizer())
    trainer.maybe_activation_offload_context = Recorder()
    trainer.train()
    assert trainer.autoaccum_guard.plan_source == "probe"
    assert len(seen) > 2 and all(seen)  # the probe's passes and every micro-batch


def test_options_are_taken_either_way_and_the_order_that_would_skip_sfts_step_is_refused(tmp_path, monkeypatch):
    prepared = []
    monkeypatch.setattr(SFTTrainer, "_prepare_dataset", lambda self, dataset, *a, **k: prepared.append(1) or dataset)

    class Other(AutoAccumTrainer, SFTTrainer):
        pass

    with pytest.raises(TypeError, match=r"Other lists AutoAccumTrainer before SFTTrainer, so AutoAccumTrainer."
                                        r"training_step would replace SFTTrainer.training_step .* List the other "
                                        r"trainer first: class Other\(SFTTrainer, AutoAccumTrainer\)"):
        Other(model=llama(), args=arguments(tmp_path, "text"), train_dataset=dataset("text"),
              processing_class=tokenizer(), micro_batch=3)
    assert prepared == []  # refused before SFTTrainer prepared anything
    monkeypatch.undo()

    class Mine(SFT):  # a subclass of the documented form takes them too
        pass

    trainer = Mine(model=llama(), args=arguments(tmp_path, "text", max_steps=1), train_dataset=dataset("text"),
                   processing_class=tokenizer(), micro_batch=3, grow_after=5)
    trainer.train()
    guard = trainer.autoaccum_guard
    assert guard.plan_source == "given" and guard.guard.plan.micro_batch == 3 and guard.guard.policy.grow_after == 5
    assert trainer.autoaccum_args.gradient_accumulation_steps == ACCUM and trainer.args.gradient_accumulation_steps == 1


def test_packed_batches_are_cut_between_whole_packed_rows(tmp_path):
    """A padding-free batch is one row of every packed row's tokens; the micro-batches are whole packed rows,
    each collated as SFTTrainer collates a batch (one row, its own position_ids and sequence boundaries)."""
    batches = []
    model = llama()
    model.register_forward_pre_hook(lambda module, args, kwargs: batches.append(kwargs), with_kwargs=True)
    trainer = SFT(model=model, args=arguments(tmp_path, "packed", max_steps=1), train_dataset=dataset("packed"),
                  processing_class=tokenizer(), micro_batch=3)
    trainer.train()
    assert [len(k["cu_seq_lens_q"]) > 2 for k in batches] == [True] * 3  # 3 + 3 + 2 packed rows, several texts each
    assert all(k["input_ids"].shape[0] == 1 and k["position_ids"].shape == k["input_ids"].shape for k in batches)
    [step] = _steps(trainer)
    assert sum(k["input_ids"].shape[1] for k in batches) == step["num_tokens"]  # every token of the step once
