"""The memory savers in use: a transformer whose one-sample step does not fit the (emulated) budget
trains to the end on the next saver (activation checkpointing of as few blocks as fit, then of all), with the
probe and the guard turning to it, and its weights equal an unconstrained run's (fp64, 1e-12). Negative controls: with
``memory_savers="off"`` the same run ends in ``DoesNotFitError``; under a budget no saver fits, the
error lists every saver tried.

Sizes (TinyGPT, vocab 64, 128 tokens, dim 32, 4 blocks, fp64, AdamW, counted by the tracked meter):
a step at micro-batch 1 peaks at about 3.3 MB without checkpointing and 1.9 MB with it; 3.5 MB at 2.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

import autoaccum
import autoaccum.cli
from autoaccum import DoesNotFitError, OOMGuard, emulated_budget
from autoaccum.demo import TinyGPT, synthetic_tokens, token_loss
from autoaccum.probe.choice import THROUGHPUT_TIE

TIGHT = {"rtol": 1e-10, "atol": 1e-12}
SEQ, TARGET, STEPS = 128, 4, 4
LADDER_ONLY = "2900KB"  # micro-batch 1 fits only with every block checkpointed
HALF_BLOCKS = "3500KB"  # micro-batch 1 fits with 2 of the 4 blocks checkpointed, not with 1
TOO_SMALL = "1MB"  # not even with checkpointing


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, seq_len=SEQ, dim=32, layers=4, heads=2).double()


def _data() -> torch.Tensor:
    return synthetic_tokens(TARGET * STEPS, SEQ, 64)


def _reference() -> dict[str, torch.Tensor]:
    """Full-batch AdamW steps with no budget at all."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _data()
    for step in range(STEPS):
        opt.zero_grad()
        token_loss(model, data[step * TARGET:(step + 1) * TARGET]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _guard_run(budgets: list[str | None], **options) -> tuple[dict[str, torch.Tensor], OOMGuard]:
    """Guarded steps at micro-batch 4, each under its own emulated budget (None: none)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = OOMGuard(model, opt, target_batch=TARGET, micro_batch=TARGET, **options)
    data = _data()
    for step, budget in enumerate(budgets):
        batch = data[step * TARGET:(step + 1) * TARGET]
        if budget is None:
            guard.step(batch, token_loss)
        else:
            with emulated_budget(budget, model, opt):
                guard.step(batch, token_loss)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, guard


@pytest.mark.parametrize(("budget", "savers"), [
    (HALF_BLOCKS, ["checkpointing:1/4", "checkpointing:2/4"]),
    (LADDER_ONLY, ["checkpointing:1/4", "checkpointing:2/4", "checkpointing"])])
def test_the_guard_checkpoints_as_few_blocks_as_fit_where_one_sample_does_not_fit_and_stays_exact(budget,
                                                                                                  savers) -> None:
    """Two steps with memory to spare, then the budget drops below one sample's step: the guard halves
    4 -> 2 -> 1, then checkpoints 1 block, then 2 (the count doubles), then all, as far as the budget needs,
    replaying the same samples each time; the weights are those of full-batch steps."""
    params, guard = _guard_run([None, None, budget, budget])
    changes = [(c.step, c.old.micro_batch, c.new.micro_batch, c.old.saver, c.new.saver) for c in guard.changes]
    climbs = [(3, 1, 1, old, new) for old, new in zip(["none", *savers], savers)]
    assert changes == [(3, 4, 2, "none", "none"), (3, 2, 1, "none", "none"), *climbs], changes
    assert guard.plan.saver == savers[-1] and guard.ooms == 2 + len(savers)
    assert "memory saver none -> checkpointing 1 of 4 blocks" in guard.changes[2].describe()
    for name, p in _reference().items():
        torch.testing.assert_close(params[name], p, **TIGHT, msg=name)


class _PausingGPT(TinyGPT):
    """TinyGPT with a fixed cost per forward pass (as a GPU's launches are at small micro-batches)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        time.sleep(0.1)
        return super().forward(tokens)


def test_the_probe_weighs_the_savers_above_the_first_that_fits_and_plans_the_fastest_pair() -> None:
    """Under 3,500 KB micro-batch 1 fits with 2 of the 4 blocks checkpointed (8 passes for 8 samples), and
    micro-batch 2 with all of them (4 passes): the saved passes' fixed cost outweighs the recomputation, so the
    probe plans (2, all blocks). Negative control: the first saver that fits (the rule before) is slower by
    more than timing noise. Every saver measured counts in the report (two warm-up steps each)."""
    torch.manual_seed(0)
    model = _PausingGPT(vocab_size=64, seq_len=SEQ, dim=32, layers=4, heads=2).double()
    data = _data()
    report = autoaccum.probe(model=model, loss_fn=token_loss, make_batch=lambda b: data[:b], target_batch=8,
                             budget=HALF_BLOCKS, headroom=0.0)
    assert [s for s, _ in report.savers_tried] == ["none", "checkpointing:1/4"]
    weighed = {s: (b, t) for s, b, t in report.savers_weighed}
    assert list(weighed) == ["checkpointing:2/4", "checkpointing"]
    assert weighed["checkpointing:2/4"][0] == 1 and weighed["checkpointing"][0] == 2
    assert report.plan == autoaccum.Plan.for_target(8, 2).with_saver("checkpointing")
    assert weighed["checkpointing:2/4"][1] > weighed["checkpointing"][1] * (1 + THROUGHPUT_TIE)
    assert report.optimizer_steps >= 2 * len(weighed)  # (and any a saver below ran before it ran out of memory)
    assert "weighed: checkpointing 2 of 4 blocks at micro-batch 1" in autoaccum.cli.format_probe(report)


def test_negative_control_without_memory_savers_the_same_run_does_not_fit() -> None:
    with pytest.raises(DoesNotFitError, match="a micro-batch of 1 does not fit") as info:
        _guard_run([None, None, LADDER_ONLY], memory_savers="off")
    assert "checkpointed" in str(info.value)  # ... and it says how to get there


def test_where_no_saver_fits_every_saver_tried_is_named() -> None:
    with pytest.raises(DoesNotFitError) as info:
        _guard_run([TOO_SMALL])
    assert [r for r, _ in info.value.savers] == ["none", "checkpointing:1/4", "checkpointing:2/4", "checkpointing"]
    assert all(b is not None and b > 1e6 for _, b in info.value.savers)
    assert "Memory savers tried" in str(info.value) and "CPUOffloadPolicy" in str(info.value)


@pytest.mark.slow
def test_after_calm_steps_at_the_smallest_micro_batch_the_guard_steps_back_down() -> None:
    """Memory comes back: after enough calm steps at micro-batch 1 with checkpointing the guard tries the
    saver below (2 of the 4 blocks, then 1, then none), one at a time; each fits, and the run goes on."""
    budgets = [None, LADDER_ONLY] + [None] * 16  # the first step makes AdamW's state: the budget counts it
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = OOMGuard(model, opt, target_batch=TARGET, micro_batch=TARGET, grow="off", grow_after=1)
    data = synthetic_tokens(TARGET * len(budgets), SEQ, 64)
    savers = []
    for step, budget in enumerate(budgets):
        batch = data[step * TARGET:(step + 1) * TARGET]
        with emulated_budget(budget, model, opt) if budget else contextlib.nullcontext():
            guard.step(batch, token_loss)
        savers.append(guard.plan.saver)
    assert savers[1] == "checkpointing" and savers[-1] == "none", savers
    down = [(c.old.saver, c.new.saver) for c in guard.changes if c.stepped_down]
    assert down == [("checkpointing", "checkpointing:2/4"), ("checkpointing:2/4", "checkpointing:1/4"),
                    ("checkpointing:1/4", "none")], down
    assert all("calm steps" in c.describe() for c in guard.changes if c.stepped_down)


def _full_batch_reference() -> torch.nn.Module:
    """The model after STEPS full-batch AdamW steps on the data in the order fit draws it (seed 0)."""
    order = torch.randperm(TARGET * STEPS, generator=torch.Generator().manual_seed(0))
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    data = _data()[order]
    for step in range(STEPS):
        ref_opt.zero_grad()
        token_loss(ref, data[step * TARGET:(step + 1) * TARGET]).backward()
        ref_opt.step()
    return ref


@pytest.mark.parametrize(("budget", "saver"), [(LADDER_ONLY, "checkpointing"), (HALF_BLOCKS, "checkpointing:2/4")])
def test_fit_plans_on_the_saver_where_one_sample_fits_and_trains_exactly(budget, saver) -> None:
    """fit's probe finds that micro-batch 1 does not fit without a saver, measures with 1 block checkpointed,
    then 2, then all, as far as it must; from the first that fits it weighs the higher ones (the plan is the
    fastest pair: timing decides between 2 of 4 blocks and all here); the run needs no OOM and equals
    full-batch steps."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = autoaccum.fit(model, _data(), target_batch=TARGET, loss_fn=token_loss, optimizer=opt, epochs=1,
                           budget=budget, headroom=0.0, progress=False, verbose=False, seed=0,
                           last_batch="drop")
    below = ["none", "checkpointing:1/4", "checkpointing:2/4", "checkpointing"]
    assert result.plan.saver in below[below.index(saver):] and result.oom_events == 0
    assert [r for r, _ in result.probe.savers_tried] == below[:below.index(saver)]
    weighed = result.probe.savers_weighed  # the first that fits, then those above it (none above: nothing weighed)
    assert [s for s, _, _ in weighed[:1]] == ([saver] if saver != below[-1] else [])
    assert result.probe.to_dict()["plan"]["saver"] == result.plan.saver
    # the bytes a saver reached before it ran out are a lower bound, and printed as one
    assert "did not fit without a memory saver (needs at least " in autoaccum.cli.format_probe(result.probe)
    got = {n: p.detach() for n, p in model.named_parameters()}
    ref = _full_batch_reference()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), **TIGHT, msg=name)


def two_rank_fit(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """fit on each of two gloo ranks under a budget only checkpointing fits (a little more than in one
    process: the gradients' flat all-reduce buffer is held too)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = autoaccum.fit(model, _data(), target_batch=TARGET, loss_fn=token_loss, optimizer=opt, epochs=1,
                           budget="3200KB", headroom=0.0, progress=False, verbose=False, seed=0)
    assert result.plan.saver == "checkpointing" and result.final_plan.saver == "checkpointing"
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_two_ranks_plan_on_the_same_saver_and_equal_full_batch_steps(tmp_path) -> None:
    import torch.distributed as dist
    from _spawn import results, spawn

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out = results(tmp_path, spawn(two_rank_fit, tmp_path)[0])
    ref = _full_batch_reference()
    for rank, params in enumerate(out):
        for name, p in ref.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), **TIGHT, msg=f"rank {rank} {name}")


@pytest.mark.gpu
def test_offload_on_cuda_gives_the_same_gradients_and_keeps_less_on_the_device() -> None:
    """MemorySaver ``offload`` (checkpointing + the forward's saved tensors in pinned host memory) on a CUDA
    model, fp64: the gradients of the step without a saver, and less device memory at the end of the
    forward than checkpointing alone."""
    from autoaccum.memory.savers import apply_saver

    device = torch.device("cuda")
    x = synthetic_tokens(8, 512, 64).to(device)
    grads, held = {}, {}
    for saver in ("none", "checkpointing", "offload"):
        torch.manual_seed(0)
        model = TinyGPT(vocab_size=64, seq_len=512, dim=128, layers=6, heads=4).double().to(device)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device)
        with apply_saver(model, saver):
            loss = token_loss(model, x)
            torch.cuda.synchronize()
            held[saver] = torch.cuda.memory_allocated(device) - base
            loss.backward()
        grads[saver] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for saver in ("checkpointing", "offload"):
        for name, g in grads["none"].items():
            torch.testing.assert_close(grads[saver][name], g, **TIGHT, msg=f"{saver} {name}")
    assert held["offload"] < held["checkpointing"] < held["none"], held


@pytest.mark.slow
def test_the_hf_trainer_integration_turns_to_through_the_models_own_switch(tmp_path) -> None:
    """AutoAccumTrainer on a GPT-2 whose one-sample step does not fit 6 MB without checkpointing (about
    9.5 MB) but does with it (3.6 MB): its probe plans on the model's own switch, and the run equals HF's
    own full-batch run without a budget (fp64)."""
    transformers = pytest.importorskip("transformers")
    from autoaccum.integrations.transformers import AutoAccumTrainer

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=256,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    rows = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, 64, (8, 256), generator=torch.Generator().manual_seed(3))]

    def run(cls, per_device: int, accum: int, budget: str | None, **options):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).double()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accum, max_steps=2, learning_rate=1e-2, optim="adamw_torch", report_to="none",
            use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0)
        trainer = cls(model=model, args=args, train_dataset=rows, **options)
        with emulated_budget(budget, model) if budget else contextlib.nullcontext():
            trainer.train()
        return trainer, {n: p.detach().clone() for n, p in model.named_parameters()}

    trainer, got = run(AutoAccumTrainer, 2, 2, "6MB")
    plan = trainer.autoaccum_guard.guard.plan
    # the loss in chunks comes first on the ladder of a causal LM, and every saver above keeps it; a vocabulary of
    # 64 gives it nothing to save (one chunk a sample), so the probe climbed to the model's own switch
    assert plan.saver == "checkpointing+chunked_loss" and plan.micro_batch == 1, plan
    assert [s for s, _ in trainer.autoaccum_guard.report.savers_tried] == ["none", "chunked_loss"]
    _, want = run(transformers.Trainer, 4, 1, None)
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, **TIGHT, msg=name)
    # memory_savers= reaches the probe: with the savers off the same run does not fit
    with pytest.raises(DoesNotFitError, match="a micro-batch of 1 does not fit"):
        run(AutoAccumTrainer, 2, 2, "6MB", memory_savers="off")


def test_the_integrations_check_memory_savers_where_they_are_built() -> None:
    """memory_savers= is an option of each integration, checked at construction like the others."""
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    accelerate = pytest.importorskip("accelerate")
    from autoaccum.integrations.accelerate import guard_for
    from autoaccum.integrations.lightning import AutoAccum
    from autoaccum.integrations.transformers import AutoAccumTrainer

    model = _model()
    with pytest.raises(ValueError, match="Invalid memory_savers: 'sometimes'"):
        AutoAccum(memory_savers="sometimes")
    with pytest.raises(ValueError, match="Invalid memory_savers: 'sometimes'"):
        AutoAccumTrainer(model=model, memory_savers="sometimes")
    with pytest.raises(ValueError, match="Invalid memory_savers: 'sometimes'"):
        guard_for(accelerate.Accelerator(cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1),
                  memory_savers="sometimes")
    assert AutoAccum(memory_savers=("checkpointing",)).options["memory_savers"] == ("checkpointing",)


# -- BatchNorm: a saver before a smaller micro-batch ---------------------------------------------------

class _NormBlock(torch.nn.Module):
    def __init__(self, dim: int, batchnorm: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.BatchNorm1d(dim) if batchnorm else torch.nn.LayerNorm(dim)
        self.batchnorm = batchnorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2) if self.batchnorm else self.norm(h)
        return x + torch.tanh(h)


class _NormNet(torch.nn.Module):
    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(_NormBlock(8, batchnorm) for _ in range(4))
        self.head = torch.nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _norm_run(batchnorm: bool, oom_at: int | None) -> tuple[dict[str, torch.Tensor], OOMGuard]:
    """Three guarded steps at micro-batch 8 of 8; at step ``oom_at`` a forward without checkpointing runs out
    of memory (injected: a real torch.OutOfMemoryError), as a device with less memory would."""
    model = _NormNet(batchnorm).double()
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=8, micro_batch=8,
                     grow="off")
    data = torch.randint(0, 16, (24, 6), generator=torch.Generator().manual_seed(3))
    step = [0]

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if step[0] == oom_at and "forward" not in m.blocks[0].__dict__:  # the first block not checkpointed
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
        logits = m(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), ids[:, 1:].reshape(-1))

    for s in range(3):
        step[0] = s
        guard.step(data[8 * s:8 * (s + 1)], loss_fn)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, guard


def test_a_batchnorm_model_takes_a_saver_before_it_halves_its_micro_batch(caplog) -> None:
    """With BatchNorm in training mode a smaller micro-batch would change the statistics; checkpointing does
    not: the guard replays the step at micro-batch 8 with the first block checkpointed, says why, and the
    weights equal the run without any OOM (fp64). Negative control: the same model with LayerNorm halves."""
    want, _ = _norm_run(True, None)
    with caplog.at_level("WARNING", logger="autoaccum.guard"):
        got, guard = _norm_run(True, 1)
    assert [(c.step, c.old.micro_batch, c.new.micro_batch, c.new.saver) for c in guard.changes] == [
        (2, 8, 8, "checkpointing:1/4")]
    assert "BatchNorm layers in training mode" in caplog.text
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=1e-12, atol=1e-14, msg=name)
    _, layer_norm = _norm_run(False, 1)
    assert [(c.old.micro_batch, c.new.micro_batch, c.new.saver) for c in layer_norm.changes][0] == (8, 4, "none")
