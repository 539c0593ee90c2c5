"""Variable-length data (issue 12): a memory model in tokens, token-budget micro-batches, an exact global batch.

The model is a small causal LM in float64 (right padding: a real token never attends to a later
pad, so padding does not change its output). Its loss is token-level, ``(loss_sum, num_items)``
over the predicted tokens, so the step divides once by the tokens of the whole global batch.
References are full-batch token-mean gradient descent on the same samples, padded to their
longest sample together.
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
from helpers import pad_rows as pad
from helpers import padded_token_loss as token_loss
from helpers import params, rel_diff

import autoaccum
from autoaccum import OOMGuard, Plan
from autoaccum.demo import TinyGPT
from autoaccum.memory import TrackedMemory
from autoaccum.plan.batch import Samples
from autoaccum.plan.cut import TokenCut
from autoaccum.plan.plan import TokenBudget

VOCAB, LONGEST = 64, 48
RTOL = 1e-10


def lm(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=VOCAB, seq_len=LONGEST, dim=32, layers=2, heads=2).to(dtype)


def rows(n: int, seed: int, longest: int = LONGEST) -> list[dict[str, torch.Tensor]]:
    """Unpadded token rows of long-tailed lengths (most short, a few up to ``longest``)."""
    rng = random.Random(seed)
    lengths = [min(longest, max(3, int(rng.lognormvariate(math.log(8), 0.7)))) for _ in range(n)]
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (length,), generator=g)} for length in lengths]


def samples(items: list[dict[str, torch.Tensor]]) -> Samples:
    return Samples(tuple(items), tuple(len(i["input_ids"]) for i in items), pad)


def full_batch_steps(model: torch.nn.Module, batches: list[list[dict]], lr: float = 0.5) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for items in batches:
        opt.zero_grad()
        loss_sum, count = token_loss(model, pad(items))
        (loss_sum / count).backward()
        opt.step()


def token_plan(target: int, max_cost: float, micro: int = 16) -> Plan:
    import dataclasses

    return dataclasses.replace(Plan.for_target(target, micro), tokens=TokenBudget(max_cost, 0.0, LONGEST))


# -- the cut -----------------------------------------------------------------------------------------

def test_the_token_cut_keeps_every_sample_once_and_each_micro_batch_under_the_budget():
    items = rows(40, seed=1)
    batch = samples(items)
    plan = token_plan(40, max_cost=96, micro=16)
    cut = TokenCut()
    steps = cut.steps(batch, 40, plan)
    micro = list(cut(batch, 40, plan, steps + 2))  # two empty micro-steps on top: what a rank with fewer gets
    filled = [m for m in micro if m.num_samples]
    assert len(filled) == steps and [m.num_samples for m in micro[steps:]] == [0, 0]
    seen = sorted(int(i) for m in filled for row, n in zip(m.batch["input_ids"], m.batch["attention_mask"].sum(1))
                  for i in [row[:n].sum()])
    assert len(seen) == 40  # every sample, once (by content)
    for m in filled:
        longest = int(m.batch["attention_mask"].sum(1).max())
        assert m.batch["input_ids"].shape[1] == longest  # padded only to its own longest
        assert m.num_samples * longest <= 96 or m.num_samples == 1
        assert m.num_samples <= 16
    lengths = [int(m.batch["attention_mask"].sum(1).max()) for m in filled]
    assert lengths == sorted(lengths, reverse=True)  # longest first: an OOM strikes early
    padding = sum(int((m.batch["attention_mask"] == 0).sum()) for m in filled)
    assert padding < int((pad(items)["attention_mask"] == 0).sum()) / 4  # far less than one padded batch


def test_a_padded_dict_batch_is_cut_by_its_attention_mask_and_trimmed():
    batch = pad(rows(24, seed=2))
    plan = token_plan(24, max_cost=64, micro=8)
    cut = TokenCut()
    micro = list(cut(batch, 24, plan, cut.steps(batch, 24, plan)))
    assert sum(m.num_samples for m in micro) == 24
    assert all(m.batch["input_ids"].shape[1] == int(m.batch["attention_mask"].sum(1).max()) for m in micro)


# -- exactness ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("oom", [False, True], ids=["no-oom", "oom-mid-step"])
def test_token_budget_micro_batches_equal_full_batch_token_mean_descent(oom):
    target = 24
    batches = [rows(target, seed=s) for s in range(4)]
    ref = lm()
    full_batch_steps(ref, batches)
    model = lm()
    where = {"step": 0, "micro": 0, "fired": False}

    def loss_fn(m, batch):
        where["micro"] += 1
        if oom and where["step"] == 1 and where["micro"] == 3 and not where["fired"]:
            where["fired"] = True  # step 2, after two of its micro-batches ran: replay it
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (injected)")
        return token_loss(m, batch)

    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.5), plan=token_plan(target, 96), cut=TokenCut())
    results = []
    for step, items in enumerate(batches):
        where.update(step=step, micro=0)
        results.append(guard.step(samples(items), loss_fn))
    assert all(r.micro_steps > 1 for r in results)  # the budget cut every step into several micro-batches
    if oom:
        assert [r.attempts for r in results] == [1, 2, 1, 1]
        assert guard.plan.tokens.max_cost == 48  # replayed with half the token budget
        assert results[1].micro_steps > results[0].micro_steps
    assert rel_diff(params(model), params(ref)) <= RTOL
    assert results[0].num_items == int(token_loss(lm(), pad(batches[0]))[1])


def test_negative_control_a_mean_of_micro_batch_means_is_not_the_step():
    target = 24
    batches = [rows(target, seed=s) for s in range(3)]
    ref = lm()
    full_batch_steps(ref, batches)
    model = lm()

    def mean_loss(m, batch):  # each micro-batch's token mean, weighted by samples: the usual mistake
        loss_sum, count = token_loss(m, batch)
        return loss_sum / count

    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.5), plan=token_plan(target, 96), cut=TokenCut())
    for items in batches:
        guard.step(samples(items), mean_loss)
    assert rel_diff(params(model), params(ref)) > 1e-4  # short and long micro-batches weighted alike


def test_fit_plans_by_tokens_from_the_data_lengths_and_trains_exactly():
    target = 24
    data = rows(96, seed=7)
    ref = lm()
    order = [torch.randperm(96, generator=torch.Generator().manual_seed(0 * 1_000_003 + 0))]
    full_batch_steps(ref, [[data[int(i)] for i in order[0][s * target:(s + 1) * target]] for s in range(4)])
    model = lm()
    result = autoaccum.fit(model, data, target, loss_fn=token_loss, collate_fn=pad, budget="3MiB", epochs=1,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.5), progress=False)
    report = result.probe
    assert result.plan.tokens is not None and report.lengths.source == "all 96 samples"
    assert report.lengths.longest == max(len(r["input_ids"]) for r in data)
    assert {c.length for c in report.candidates} >= {report.lengths.shortest, report.lengths.longest}
    assert result.oom_events == 0 and result.optimizer_steps == 4 and result.samples_seen == 96
    assert rel_diff(params(model), params(ref)) <= RTOL


# -- the memory model ----------------------------------------------------------------------------------

def test_the_token_memory_model_predicts_unseen_sizes_and_lengths_within_10_percent():
    """Sizes near the budget (where a plan operates: 60-100% of the token budget) at lengths the probe
    did not measure; the peak is that of an accumulation's later micro-batch, measured by the tracked
    counter."""
    model = lm(dtype=torch.float32)
    lengths = tuple(len(r["input_ids"]) for r in rows(400, seed=3))

    def make_batch(b: int, length: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(b * 1000 + length)
        return pad([{"input_ids": torch.randint(1, VOCAB, (length,), generator=g)} for _ in range(b)])

    report = autoaccum.probe(model=model, loss_fn=token_loss, make_batch=make_batch, target_batch=128,
                             budget="6MiB", lengths=lengths, lengths_source="400 rows")
    tm, tokens = report.token_model, report.plan.tokens
    assert tm is not None and tokens is not None and report.probe_ooms == 0
    measured = {(c.micro_batch, c.length) for c in report.candidates}
    optimizer = torch.optim.AdamW(model.parameters())
    token_loss(model, make_batch(2, 8))[0].backward()
    optimizer.step()  # the optimizer's state exists, as in training
    pairs = [(int(fraction * tokens.max_batch(length)), length) for fraction, length in
             [(1.0, 40), (0.8, 33), (0.6, 24), (0.9, 17), (0.7, 11)]]
    for b, length in pairs:
        assert (b, length) not in measured and 1 <= b <= 128
        batch = make_batch(b, length)
        # an accumulation's later micro-batch: the gradients of earlier ones held
        with TrackedMemory().track(model, optimizer, batch) as mem:
            mem.reset_peak()
            token_loss(model, batch)[0].backward()
        error = tm.predict(b, length) / mem.peak_bytes - 1
        assert abs(error) <= 0.10, (b, length, tm.predict(b, length), mem.peak_bytes)
        assert mem.peak_bytes <= report.usable_bytes * 1.02  # what the budget lets in fits
    optimizer.zero_grad()


def test_the_plan_never_gives_a_micro_batch_more_than_fits_at_its_length():
    tokens = TokenBudget(max_cost=1000.0, quadratic=0.01, longest=100)
    assert tokens.max_batch(100) == 5  # 100 + 0.01 * 100^2 = 200 per sample
    assert tokens.max_batch(10) == 90  # 10 + 1 = 11
    assert tokens.halved().max_batch(100) == 2


def test_the_cut_of_one_batch_is_never_served_for_another(monkeypatch):
    """A regression: the cutter remembered the last batch by id(), and a freed batch's id is reused by
    the next -- a step was cut by the previous step's lengths (micro-batches over the budget; OOMs in
    the variable-length benchmark). Here every id collides: the cutter must still cut each batch."""
    import importlib

    monkeypatch.setattr(importlib.import_module("autoaccum.plan.cut"), "id", lambda obj: 42, raising=False)
    plan = token_plan(32, max_cost=96)
    cut = TokenCut()
    cut.groups(samples(rows(32, seed=1)), plan)
    again = samples(rows(32, seed=2))
    groups = cut.groups(again, plan)
    lengths = again.lengths
    assert sorted(i for g in groups for i in g) == list(range(32))
    assert all(len(g) * max(lengths[i] for i in g) <= 96 or len(g) == 1 for g in groups)


# -- on two ranks ------------------------------------------------------------------------------------

def two_ranks_token_cut(rank: int, world_size: int) -> dict:
    from autoaccum.distributed import DistributedSync

    target = 24
    batches = [rows(target, seed=s) for s in range(3)]
    model = lm()
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.5), plan=token_plan(target, 96).with_world_size(2),
                     cut=TokenCut(), sync=DistributedSync(model))
    # uneven lengths per rank: rank 0 takes the 12 shortest of each global batch, rank 1 the 12 longest
    steps = []
    for items in batches:
        ordered = sorted(items, key=lambda r: len(r["input_ids"]))
        mine = ordered[:12] if rank == 0 else ordered[12:]
        result = guard.step(samples(mine), token_loss)
        steps.append((result.micro_steps, len(TokenCut().groups(samples(mine), guard.plan))))
    return {"params": params(model), "steps": steps}


@pytest.mark.slow
def test_two_ranks_with_uneven_lengths_equal_full_batch_token_mean_descent(tmp_path):
    """Each rank cuts its own share by tokens -- a different number of micro-batches on each -- and
    both run the larger count (empty micro-steps on the other); the token count is over both ranks."""
    from _spawn import results, spawn

    codes, _ = spawn(two_ranks_token_cut, tmp_path)
    out = results(tmp_path, codes)
    ref = lm()
    full_batch_steps(ref, [rows(24, seed=s) for s in range(3)])
    for r in out:
        assert rel_diff(r["params"], params(ref)) <= RTOL
    own = [[groups for _, groups in r["steps"]] for r in out]
    ran = [[micro for micro, _ in r["steps"]] for r in out]
    assert ran[0] == ran[1] == [max(a, b) for a, b in zip(*own)]  # every rank ran the same micro-steps
    assert any(a != b for a, b in zip(*own))  # ... though their own cuts differed


@pytest.mark.parametrize("bad", [0, -3, 2.5, None, "8"])
def test_a_length_fn_returning_no_length_is_named_with_the_sample(bad):
    """``length_fn`` returning 0 met "Task.lengths must be a non-empty sequence of ints >= 1", an internal name.
    Control: len, and numpy or 0-d tensor ints, are lengths."""
    import numpy as np

    from autoaccum.plan.lengths import checked_length_fn

    with pytest.raises(ValueError, match=rf"length_fn returned {re.escape(repr(bad))} for a sample \(a tensor of "
                                         rf"shape \[8\]\).*an int >= 1"):
        checked_length_fn(lambda s: bad)(torch.zeros(8))
    for fn in (len, lambda s: np.int64(len(s)), lambda s: torch.tensor(len(s))):
        assert checked_length_fn(fn)(torch.zeros(8)) == 8


def test_a_list_of_more_tensors_than_rows_is_a_list_of_samples_and_a_bad_length_fn_is_named_before_work():
    """A list of 64 token sequences of 8 tokens was read as 64 columns of 8 samples ("data holds 8 samples"); it
    is 64 samples (a tuple, or a list no longer than its rows, stays columns), and length_fn=lambda s: 0 is named."""
    from autoaccum.plan.data import GlobalBatches

    seqs = [torch.full((8,), i) for i in range(64)]
    batches = GlobalBatches(seqs, 16)
    assert batches.num_samples == 64 and batches.dataset is seqs
    assert GlobalBatches(tuple(seqs[:2]), 4).num_samples == 8  # columns
    assert GlobalBatches([torch.zeros(10, 3), torch.zeros(10)], 5).num_samples == 10  # [x, y]: columns
    with pytest.raises(ValueError, match=r"length_fn returned 0"):
        GlobalBatches(seqs, 16, length_fn=lambda s: 0, by_length=True).lengths()
