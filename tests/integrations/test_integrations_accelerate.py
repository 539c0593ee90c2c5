"""``guard_for`` (autoaccum.integrations.accelerate) in an Accelerate loop, against Accelerate's own
full-batch loop on the same samples in the same order.

The loop is the one of examples/accelerate_loop.py: ``accelerator.prepare`` -> per batch
``guard.accumulate`` (or, for the reference, ``accelerator.backward`` of the whole batch) ->
``accelerator.clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()``.
GPT-2 from a config, fp64, dropout off, padded rows; the loss is the model's own through
``autoaccum.step.losses.default_loss`` (token-exact: the step's predicted tokens counted up front and
passed as ``num_items_in_batch``). The loader yields global batches of 8; ids ride in the first token.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _audit import IdAudit

from autoaccum import emulated_budget, parse_bytes
from autoaccum.step.losses import default_loss

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from _token_rows import N, Rows, collate, gpt2, ids_of  # noqa: E402
from helpers import needs_gloo, params, rel_diff  # noqa: E402

from autoaccum.integrations.accelerate import guard_for  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10
GLOBAL = 8
STEPS = N // GLOBAL


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps process-wide singletons (AcceleratorState, GradientState); each run starts anew."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run(guarded: bool, *, budget: str | None = None, drop: tuple[int, str] | None = None, accum: int = 1,
        micro_batch: int | None = None, stop_after: int | None = None, save_to: str | None = None,
        resume_from: str | None = None, batch_size: int = GLOBAL, guard_budget: str | None = None) -> dict:
    """One training run (``budget``: an ``emulated_budget`` around the loop; ``guard_budget``: ``guard_for``'s
    ``budget=``); returns the model's parameters, the audit and the guard."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accum)
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    loader = torch.utils.data.DataLoader(Rows(), batch_size=batch_size, collate_fn=collate)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    guard = guard_for(accelerator, model, optimizer, micro_batch=micro_batch, budget=guard_budget) if guarded else None
    if guard is not None:
        accelerator.register_for_checkpointing(guard)  # its plan goes with Accelerate's checkpoints
    audit = IdAudit(model)
    audit.hook_forward(accelerator.unwrap_model(model), ids_of)
    audit.watch(optimizer)
    if resume_from is not None:
        accelerator.load_state(resume_from)
        loader = accelerator.skip_first_batches(loader, stop_after or 0)
    meter = emulated_budget(budget, model) if budget is not None else contextlib.nullcontext()
    steps = 0 if resume_from is None else (stop_after or 0)
    with meter:
        for batch in loader:
            if guard is not None:
                guard.accumulate(batch, default_loss)
            else:
                with accelerator.accumulate(model):  # the reference (accum 1), or Accelerate's own accumulation
                    accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                audit.step()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            steps += accelerator.sync_gradients
            if drop is not None and steps == drop[0]:
                (guard.emulated if guard_budget is not None else meter).budget_bytes = parse_bytes(drop[1])
            if save_to is not None and steps == stop_after:
                accelerator.save_state(save_to)
                break
    return {"params": params(accelerator.unwrap_model(model)), "audit": audit, "guard": guard,
            "scheduler_steps": schedule.scheduler.last_epoch, "steps": steps}


@pytest.fixture(scope="module")
def reference(one_thread):
    """Accelerate's own loop, one forward/backward of each whole global batch."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    out = run(False)
    return {"params": out["params"], "steps": out["audit"].steps}


def test_under_a_budget_that_forces_accumulation_it_equals_accelerates_full_batch_loop(reference):
    out = run(True, budget="2MiB")
    guard = out["guard"]
    assert guard.plan_source == "probe" and guard.guard.plan.target_batch == GLOBAL and guard.guard.plan.accum_steps > 1
    assert rel_diff(out["params"], reference["params"]) <= RTOL
    assert out["audit"].steps == reference["steps"]
    assert out["audit"].check() == {"steps": STEPS, "repeated": 0, "inconsistent": 0}
    assert out["steps"] == out["scheduler_steps"] == STEPS  # the scheduler stepped once per optimizer step


def test_the_budget_dropped_mid_run_is_recovered_in_place(reference):
    out = run(True, budget="2MiB", drop=(2, "1.45MiB"), micro_batch=3)
    guard = out["guard"].guard
    assert guard.ooms >= 1 and guard.plan.micro_batch < 3
    assert [c.step for c in guard.changes] == [3] * len(guard.changes)
    assert out["audit"].steps == reference["steps"]  # nothing repeated or lost
    assert out["audit"].check()["inconsistent"] == 0
    assert rel_diff(out["params"], reference["params"]) <= RTOL


def test_accelerates_checkpoint_and_resume_keep_working_and_keep_the_plan(reference, tmp_path):
    first = run(True, micro_batch=3, stop_after=2, save_to=str(tmp_path))
    assert first["steps"] == 2
    resumed = run(True, stop_after=2, resume_from=str(tmp_path))  # no plan given: the checkpoint's
    assert resumed["guard"].plan_source == "checkpoint" and resumed["guard"].guard.plan.micro_batch == 3
    assert resumed["audit"].steps == reference["steps"][2:]
    assert rel_diff(resumed["params"], reference["params"]) <= RTOL


def test_negative_control_accelerates_own_accumulation_of_micro_batch_means_differs(reference):
    """``accelerator.accumulate`` with 4 steps of 2: each micro-batch's token mean divided by 4. The
    padded rows hold different numbers of tokens, so this is not the full-batch step."""
    out = run(False, accum=4, batch_size=2)
    assert out["audit"].steps == reference["steps"]  # the same samples per optimizer step...
    assert rel_diff(out["params"], reference["params"]) > 1e-6  # ...and another gradient


def test_gradient_accumulation_configured_in_accelerate_is_refused():
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = gpt2()
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2 \(the guard accumulates"):
        guard_for(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_guard_for_checks_its_options_when_it_is_called():
    accelerator = accelerate.Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"Invalid headroom: 2"):
        guard_for(accelerator, model, optimizer, headroom=2)
    foreign = {"plan": {"micro_batch": 4, "accum_steps": 2, "world_size": 1, "target_batch": 8},
               "model_fingerprint": "0" * 64, "model_summary": "MLP: 10 parameters (10 trainable), float32"}
    with pytest.raises(ValueError, match=r"plan= is a probe report measured on another model \(MLP: 10 parameters"):
        guard_for(accelerator, model, optimizer, plan=foreign)


def _prepared_gpt2():
    """A GPT-2, SGD and the rows' loader through ``accelerator.prepare``, and ``guard_for`` at micro-batch 4."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(Rows(), batch_size=GLOBAL, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader, guard_for(accelerator, model, optimizer, micro_batch=4)


def test_sync_gradients_left_false_is_named_for_what_it_is():
    """An accumulate block that ended with an exception leaves Accelerate's shared GradientState at
    sync_gradients=False with gradient_accumulation_steps=1: the refusal says so (and how to reset it) instead
    of calling it accumulation switched on; reset, the same guard runs (the negative control)."""
    accelerator, model, optimizer, loader, guard = _prepared_gpt2()
    batch = next(iter(loader))
    # the state a crashed accumulation left in the head-to-head's in-process runs (GradientState is shared)
    accelerator.gradient_state._set_sync_gradients(False)
    with pytest.raises(ValueError, match=r"sync_gradients is False with gradient_accumulation_steps=1: .*an earlier "
                                         r"accumulate block ended with an exception.*_set_sync_gradients\(True\)"):
        guard.accumulate(batch, default_loss)
    accelerator.gradient_state._set_sync_gradients(True)
    guard.accumulate(batch, default_loss)
    optimizer.step()


def test_accelerates_accumulation_switched_on_during_the_run_is_refused_at_the_next_step():
    """``accelerator.gradient_accumulation_steps = 2`` after step 2: Accelerate would step once per 2 batches,
    each from the gradients the guard cleared, the last batch's alone. Refused at step 3, before its forward.
    Negative control: set back to 1, the same guard runs on."""
    accelerator, model, optimizer, loader, guard = _prepared_gpt2()
    steps = 0
    with pytest.raises(ValueError, match=r"Accelerate's gradient accumulation is on \(gradient_accumulation_steps=2, "
                                         r"sync_gradients=False\): it must stay 1"):
        for batch in loader:
            if steps == 2:
                accelerator.gradient_accumulation_steps = 2
            with accelerator.accumulate(model):
                guard.accumulate(batch, default_loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    assert steps == 2 and guard.guard.steps == 2
    accelerator.gradient_accumulation_steps = 1
    for batch in loader:
        with accelerator.accumulate(model):  # (at 1 it syncs every batch: harmless)
            guard.accumulate(batch, default_loss)
        optimizer.step()
        optimizer.zero_grad()
    assert guard.guard.steps == 2 + STEPS


@pytest.mark.slow
def test_the_example_runs_and_recovers_in_place():
    example = Path(__file__).resolve().parents[2] / "examples" / "accelerate_loop.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=180, env=env,
                          cwd=example.parent.parent)
    assert proc.returncode == 0, proc.stderr
    assert "first plan (probe): batch 256 = 128 x 2 (2 micro-batches)" in proc.stdout
    # halved to 64 at the drop, then grown into the room left (memory-guided growth, the default)
    assert "16 optimizer steps, 1 OOM(s) replayed, plan now batch 256 = 86 + 85 x 2 (3 micro-batches)" in proc.stdout
    assert float(proc.stdout.rsplit("full-batch loop: ", 1)[1].split()[0]) < 1e-12
    assert "OOM in " in proc.stderr and "; the global batch is unchanged" in proc.stderr  # the guard's log line


# -- two processes (gloo), the DDP wrapper Accelerate returns ---------------------------------------------
@pytest.mark.slow  # two spawned processes, each importing its framework
def test_two_processes_on_the_ddp_model_accelerate_prepared(tmp_path):
    """An MLP with a token-level loss (tests/_accelerate_ranks.py): the step divides by the targets of
    the whole global batch over both ranks. Rank 1 alone runs out of memory at step 3."""
    from _accelerate_ranks import GLOBAL as GLOBAL_2
    from _accelerate_ranks import two_process_loop
    from _mlp_rows import mlp, samples, token_loss
    from test_distributed import results, spawn

    ranks = results(tmp_path, spawn(two_process_loop, tmp_path)[0])
    assert [r["wrapper"] for r in ranks] == ["DistributedDataParallel"] * 2
    assert [r["changes"] for r in ranks] == [[(3, "oom")]] * 2 and ranks[0]["plan"] == ranks[1]["plan"]
    assert ranks[0]["plan"]["world_size"] == 2 and ranks[0]["plan"]["micro_batch"] < 3
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))
    batches = [sorted(a + b) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"])]
    rows = samples(padded=True)
    assert [len(b) for b in batches] == [GLOBAL_2] * (len(rows) // GLOBAL_2)
    assert sorted(i for b in batches for i in b) == list(range(len(rows)))
    # one process, one forward/backward per global batch of those samples, divided by all its targets
    net = mlp()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for batch in batches:
        total, count = token_loss(net, torch.utils.data.default_collate([rows[i] for i in batch]))
        (total / count).backward()
        optimizer.step()
        optimizer.zero_grad()
    got, want = ranks[0]["params"], [p.detach() for p in net.parameters()]
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) / max(float(b.abs().max()) for b in want) <= RTOL


@needs_gloo
@pytest.mark.slow  # two spawned processes
def test_plain_torchrun_on_cpu_where_accelerate_sees_one_process_of_two_is_refused(tmp_path):
    """Plain ``torchrun`` on CPU: ``Accelerator()`` reports one process (``DistributedType.NO``) and leaves the
    loader unsharded, while the process group holds two ranks. The guard would take the group and announce
    ``... per rank x 2 ranks`` while both ranks train on the same samples: refused, naming both numbers and the
    remedies. Control: with ``ACCELERATE_USE_CPU=1`` (the remedy named) Accelerate shards the loader and it runs."""
    from _accelerate_torchrun import torchrun_loop
    from _spawn import results, spawn

    ranks = results(tmp_path, spawn(torchrun_loop, tmp_path)[0])
    for r in ranks:
        plain = r["plain"]
        assert (plain["distributed_type"], plain["num_processes"]) == ("DistributedType.NO", 1)
        assert plain["refused"] is not None and re.search(
            r"accelerator.num_processes=1 \(distributed type NO\) under a torch.distributed process group of 2 "
            r"ranks: .*the same samples.*`accelerate launch`.*ACCELERATE_USE_CPU=1", plain["refused"]), plain["refused"]
        assert r["use_cpu"]["refused"] is None and r["use_cpu"]["world_size"] == 2
    a, b = (r["use_cpu"]["seen"] for r in ranks)
    assert len(a) == len(b) > 0 and all(not set(x) & set(y) for x, y in zip(a, b))  # each rank its own samples


def test_a_misspelled_keyword_is_refused_where_the_guard_is_built_naming_the_closest():
    """``guard_for(..., budgett="2MiB")`` used to pass into the guard options and fail only at the first step,
    after the probe; it is refused at once, naming the keyword meant. Control: the right spelling is taken."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(TypeError, match=r"budgett.*budget"):
        guard_for(accelerator, model, optimizer, budgett="2MiB")
    with pytest.raises(TypeError, match=r"max_grad_nrom.*max_grad_norm"):
        guard_for(accelerator, model, optimizer, max_grad_nrom=1.0)
    assert guard_for(accelerator, model, optimizer, budget="2MiB", max_grad_norm=1.0).guard is None


def test_plan_is_the_plan_in_force_after_the_first_step():
    """``guard_for(...).plan`` is None before the first batch (nothing planned yet) and the guard's plan after it;
    the plan given stays ``given_plan``."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Rows(), batch_size=GLOBAL, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    guard = guard_for(accelerator, model, optimizer, micro_batch=4)
    assert guard.plan is None and guard.given_plan is None
    guard.accumulate(next(iter(loader)), default_loss)
    assert guard.plan is guard.guard.plan and (guard.plan.micro_batch, guard.plan.accum_steps) == (4, 2)


@pytest.mark.parametrize("kind", ["DEEPSPEED", "FSDP"])
def test_a_sharding_engine_is_refused_naming_what_works(kind):
    """DeepSpeed owns backward, and Accelerate's FSDP plugin is not driven (neither runs on one CPU process, so the
    accelerator here reports the type as a launched one would): refused where the guard is built, naming FSDP2
    under torchrun. Control: the same accelerator reporting no distributed type is taken."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    launched = SimpleNamespace(gradient_accumulation_steps=1, distributed_type=getattr(DistributedType, kind),
                               num_processes=1)
    with pytest.raises(ValueError, match=r"guard_for cannot drive .*(DEEPSPEED|FSDP).*fully_shard under torchrun.*"
                                         r"DistributedSync\(model\)"):
        guard_for(launched, model, optimizer)
    accelerator = accelerate.Accelerator(cpu=True)
    assert accelerator.distributed_type == DistributedType.NO
    assert guard_for(accelerator, model, optimizer).guard is None
