"""autoaccum.training.fit: equal to a hand-written full-batch loop, OOM mid-run, SIGKILL + resume, LR rules,
evaluation, metrics, quiet output, data kinds and bad input.

Every exactness test compares against a reference in ``_fit_models`` that shares no code with
autoaccum (it draws the documented sample order itself) and has a negative control.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _fit_models import (
    RESUME_EPOCHS,
    RESUME_SAMPLES,
    Mlp,
    cross_entropy,
    global_batches,
    gpt,
    gpt_tokens,
    max_abs_diff,
    mlp_data,
    reference_fit,
    resumable_run,
    token_loss,
)
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import autoaccum
from autoaccum import state
from autoaccum.errors import AutoAccumError, NonFiniteError, TaskError
from autoaccum.plan.plan import Plan
from autoaccum.training import checkpoint

TESTS_DIR = Path(__file__).resolve().parents[1]
N, TARGET, EPOCHS = 150, 64, 2  # 64 + 64 + 22 per epoch: every epoch ends with a partial batch


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- equal to a hand-written full-batch loop (fp64, TinyGPT) ---------------------------------------

@pytest.fixture(scope="module")
def tokens():
    return gpt_tokens(N)


def _gpt_reference(tokens, **kwargs):
    model = gpt()
    losses = reference_fit(model, lambda m, idx: token_loss(m, tokens[idx]), N, TARGET, epochs=EPOCHS, **kwargs)
    return model, losses


@pytest.fixture(scope="module")
def reference(tokens):
    return _gpt_reference(tokens)


@pytest.fixture(scope="module")
def gpt_peaks(tokens, tmp_path_factory):
    """Emulated peak bytes of the first two steps at micro-batches 8 and 16 (the optimizer state
    that AdamW creates in step 1 makes step 2's peak higher)."""
    peaks = {}
    for micro in (8, 16):
        log = tmp_path_factory.mktemp("peaks") / "log.jsonl"
        autoaccum.fit(gpt(), tokens, TARGET, loss_fn=token_loss, plan=Plan.for_target(TARGET, micro),
                      budget="1GiB", max_steps=2, progress=False, log_file=log)
        peaks[micro] = [r["peak_bytes"] for r in _records(log)]
    return peaks


def test_fit_equals_full_batch_loop_fp64(tokens, reference, gpt_peaks, tmp_path):
    ref_model, ref_losses = reference
    budget = max(gpt_peaks[8]) + 4096  # micro 8 fits, with little to spare
    model = gpt()
    log = tmp_path / "log.jsonl"
    result = autoaccum.fit(model, tokens, TARGET, loss_fn=token_loss, plan=Plan.for_target(TARGET, 8),
                           budget=budget, epochs=EPOCHS, progress=False, log_file=log)
    assert (result.plan.micro_batch, result.plan.accum_steps) == (8, 8)
    assert result.oom_events == 0 and result.plan_changes == () and result.final_plan == result.plan
    assert result.optimizer_steps == 6 and result.samples_seen == EPOCHS * N
    assert 0 < result.peak_bytes <= budget
    assert [r["samples"] for r in _records(log)] == [64, 128, 150, 214, 278, 300]
    assert max_abs_diff(model, ref_model) < 1e-10
    assert result.losses == pytest.approx(ref_losses, rel=1e-12, abs=0)


def test_negative_controls_differ(tokens, reference):
    ref_model, _ = reference
    other_seed, _ = _gpt_reference(tokens, seed=1)
    unweighted, _ = _gpt_reference(tokens, unweighted_micro=8)  # 22 = 8 + 8 + 6, each mean weighted 1/3
    assert max_abs_diff(other_seed, ref_model) > 1e-4
    assert max_abs_diff(unweighted, ref_model) > 1e-7  # far above the 1e-10 the test above allows


def test_oom_mid_run_changes_nothing_but_the_plan(tokens, reference, gpt_peaks, tmp_path):
    ref_model, ref_losses = reference
    # micro 16 fits step 1 but not step 2 (AdamW's state exists then); micro 8 fits throughout
    budget = (gpt_peaks[16][0] + gpt_peaks[16][1]) // 2
    assert gpt_peaks[16][0] < budget < gpt_peaks[16][1] and max(gpt_peaks[8]) < budget
    model = gpt()
    log = tmp_path / "log.jsonl"
    result = autoaccum.fit(model, tokens, TARGET, loss_fn=token_loss, plan=Plan.for_target(TARGET, 16),
                           budget=budget, epochs=EPOCHS, progress=False, log_file=log, grow="off")
    assert result.oom_events == 1
    [change] = result.plan_changes
    assert (change.step, change.reason, change.old.micro_batch, change.new.micro_batch) == (2, "oom", 16, 8)
    assert result.plan.micro_batch == 16 and result.final_plan == Plan.for_target(TARGET, 8)
    records = _records(log)
    assert [r["micro_batch"] for r in records] == [16, 8, 8, 8, 8, 8]
    assert [r["accum_steps"] for r in records] == [4, 8, 8, 8, 8, 8]
    assert [r["ooms"] for r in records] == [0, 1, 0, 0, 0, 0]
    assert {r["lr"] for r in records} == {1e-3} and result.lr == 1e-3  # an OOM never changes the LR
    assert result.peak_bytes <= budget
    assert max_abs_diff(model, ref_model) < 1e-10
    assert result.losses == pytest.approx(ref_losses, rel=1e-12, abs=0)


def test_by_default_the_guard_grows_into_the_room_halving_left_and_stays_exact(tokens, reference, gpt_peaks):
    """The same OOM as above, with fit's default growth: after two calm steps the guard grows from 8
    straight to the largest micro-batch predicted to fit under the budget with its 10% headroom
    (13: 64 in 5 micro-steps), runs out of memory no more, and the run is still the loop's."""
    ref_model, ref_losses = reference
    budget = (gpt_peaks[16][0] + gpt_peaks[16][1]) // 2
    model = gpt()
    result = autoaccum.fit(model, tokens, TARGET, loss_fn=token_loss, plan=Plan.for_target(TARGET, 16),
                           budget=budget, epochs=EPOCHS, progress=False)
    assert [(c.step, c.reason, c.old.micro_batch, c.new.micro_batch) for c in result.plan_changes] == [
        (2, "oom", 16, 8), (5, "grow", 8, 13)]
    assert result.oom_events == 1 and result.final_plan == Plan.for_target(TARGET, 13)
    assert result.peak_bytes <= budget
    assert max_abs_diff(model, ref_model) < 1e-10
    assert result.losses == pytest.approx(ref_losses, rel=1e-12, abs=0)


def test_probed_plan_under_a_budget_equals_the_loop(tokens, reference, gpt_peaks):
    ref_model, _ = reference
    budget = (gpt_peaks[16][0] + gpt_peaks[16][1]) // 2
    model = gpt()
    result = autoaccum.fit(model, tokens, TARGET, loss_fn=token_loss, budget=budget, epochs=EPOCHS, progress=False)
    assert result.plan_source == "probe" and result.probe is not None and result.probe_time_s > 0
    # above 16 only with a memory saver (which the probe weighs where fewer passes may pay)
    assert (result.final_plan.micro_batch <= 16 or result.final_plan.saver != "none") and result.peak_bytes <= budget
    # whatever the probe picked and the guard did, the probe left no trace and the result is the loop's
    assert max_abs_diff(model, ref_model) < 1e-10


# -- resume after SIGKILL: bit for bit (CPU, fp32) -----------------------------------------------

_CHILD = """
import io, os, signal, sys
import torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
import autoaccum.training.checkpoint as ckpt
from _fit_models import cross_entropy, resumable_run

mode, at, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
calls = [0]

def tick():
    calls[0] += 1
    return calls[0] == at

loss_fn = None
if mode == "step":  # killed in the forward of a micro-batch, mid-step
    def loss_fn(model, batch):
        if tick():
            os.kill(os.getpid(), signal.SIGKILL)
        return cross_entropy(model, batch)
elif mode == "rename":  # killed between the two renames of a save: only <name>.prev is left
    real_replace = os.replace
    def replace(src, dst):
        if tick():
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)
    ckpt.os.replace = replace
elif mode == "write":  # killed halfway through writing the temp file
    real_save = torch.save
    def save(obj, f):
        if not tick():
            return real_save(obj, f)
        buffer = io.BytesIO()
        real_save(obj, buffer)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt.torch.save = save
resumable_run(directory, loss_fn=loss_fn)
print("not killed")
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return resumable_run(tmp_path_factory.mktemp("full"))


@pytest.mark.parametrize(("mode", "at", "resumes_after"), [
    ("step", 15, 4),  # 4 + 4 + 2 micro-batches per epoch: call 15 is the first of step 5 (epoch 1)
    ("rename", 5, 2),  # save k >= 2 renames twice: call 5 is save 3's; falls back to save 2's .prev
    ("write", 4, 3),  # save 4 cut short: save 3 (the end of epoch 0) stays the newest
])
def test_resume_after_sigkill_is_bit_identical(mode, at, resumes_after, uninterrupted, tmp_path):
    full_result, full_model = uninterrupted
    directory = tmp_path / "ckpt"
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=str(TESTS_DIR)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, str(script), mode, str(at), str(directory)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    names = sorted(p.name for p in directory.iterdir())
    if mode == "rename":
        assert "checkpoint.pt" not in names and "checkpoint.pt.prev" in names
    if mode == "write":
        assert any(n.endswith(".tmp") for n in names) and "checkpoint.pt" in names

    log = tmp_path / "resumed.jsonl"
    if mode == "rename":
        with pytest.warns(RuntimeWarning, match="loaded the previous one"):
            result, model = resumable_run(directory, log_file=log)
    else:
        result, model = resumable_run(directory, log_file=log)
    assert result.plan_source == "checkpoint"
    assert [r["step"] for r in _records(log)][0] == resumes_after + 1  # it resumed, did not start afresh
    assert result.optimizer_steps == full_result.optimizer_steps == 3 * RESUME_EPOCHS
    assert result.samples_seen == full_result.samples_seen == RESUME_SAMPLES * RESUME_EPOCHS
    # this call's steps: those after the checkpoint (the checkpoint keeps the last loss, not every step's)
    assert result.losses == full_result.losses[resumes_after:] and result.final_loss == full_result.final_loss
    assert result.lr == full_result.lr == pytest.approx(0.05 * math.sqrt(2))
    for (name, a), b in zip(model.named_parameters(), full_model.parameters()):
        assert torch.equal(a, b), name
    assert not any(p.name.endswith(".tmp") for p in directory.iterdir())  # the next save cleaned up


def test_resume_with_another_rng_state_differs(uninterrupted, tmp_path):
    # negative control for the test above: dropout draws from the global RNG, so a resume that did
    # not restore it (here: a checkpoint whose RNG state was replaced) is not bit-identical
    _, full_model = uninterrupted
    directory = tmp_path / "ckpt"
    resumable_run(directory, max_steps=4)
    saved = checkpoint.load_checkpoint(directory)
    torch.manual_seed(999)
    saved["rng"] = checkpoint.rng_to_plain(state.capture_rng())
    checkpoint.save_checkpoint(directory, saved)
    _, resumed = resumable_run(directory)
    assert any(not torch.equal(a, b) for a, b in zip(resumed.parameters(), full_model.parameters()))


def test_resume_of_a_finished_run_trains_no_more(uninterrupted, tmp_path):
    full_result, full_model = uninterrupted
    directory = tmp_path / "done"
    resumable_run(directory)
    result, model = resumable_run(directory)
    assert result.optimizer_steps == full_result.optimizer_steps and result.losses == ()
    assert result.final_loss == full_result.final_loss  # the checkpoint's last loss
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), full_model.parameters()))


def test_resumed_metrics_file_holds_each_step_once(tmp_path):
    """A run stopped at step 6 (checkpoint at step 4, a line torn by the kill) and resumed with the same
    log_file: the lines of steps 5 and 6 written before the stop are dropped first, so the file holds
    steps 1..9 once each, equal to an uninterrupted run's (an earlier run's lines before them kept)."""
    full_log = tmp_path / "full.jsonl"
    resumable_run(tmp_path / "full", log_file=full_log, checkpoint_every=4)
    log, directory = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    earlier = [{"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0}]  # another run appended to the same file
    log.write_text("".join(json.dumps(r) + "\n" for r in earlier))
    calls = [0]

    def stop_in_step_6(m, batch):
        calls[0] += 1
        if calls[0] == 19:  # 4 + 4 + 2 micro-batches per epoch: call 19 is step 6's first
            raise RuntimeError("stopped")
        return cross_entropy(m, batch)

    with pytest.raises(RuntimeError, match="stopped"):
        resumable_run(directory, loss_fn=stop_in_step_6, log_file=log, checkpoint_every=4)
    assert [r["step"] for r in _records(log)] == [1, 2, 1, 2, 3, 4, 5]
    with log.open("a") as f:
        f.write('{"step": 6, "epoch": 1, "lo')  # a kill in the middle of a write
    result, _ = resumable_run(directory, log_file=log, checkpoint_every=4)
    records = _records(log)
    assert [r["step"] for r in records] == [1, 2] + list(range(1, 10))
    assert records[:2] == earlier
    want = _records(full_log)
    for key in ("step", "epoch", "loss", "lr", "samples", "micro_batch", "accum_steps"):
        assert [r[key] for r in records[2:]] == [r[key] for r in want], key
    assert [r["loss"] for r in records[-len(result.losses):]] == list(result.losses)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".metrics")]  # no temp file left


def test_truncate_metrics_cuts_only_the_tail(tmp_path):
    from autoaccum.training.progress import truncate_metrics

    log = tmp_path / "m.jsonl"
    assert truncate_metrics(log, 3) == 0 and not log.exists()
    lines = [json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4, 5)]
    log.write_text("".join(lines))
    assert truncate_metrics(log, 5) == 0 and log.read_text() == "".join(lines)  # nothing after the checkpoint
    assert truncate_metrics(log, 3) == 2 and log.read_text() == "".join(lines[:3])
    log.write_text("".join(lines[:3]) + '{"step": 2}')  # a parseable last line without its newline: torn
    assert truncate_metrics(log, 3) == 1 and log.read_text() == "".join(lines[:3])
    log.write_text("".join(lines[:3]) + '{"st')  # torn mid-line: not JSON, no newline
    assert truncate_metrics(log, 3) == 1 and log.read_text() == "".join(lines[:3])


def test_resuming_onto_a_file_that_is_not_a_metrics_file_is_refused_and_the_file_kept(tmp_path):
    """A user's notes given as log_file=: resuming would cut the file back to the checkpoint's step, which
    used to delete every line of it (none parses as a step). It is refused, naming the file, and kept."""
    ckpt = tmp_path / "ckpt"
    autoaccum.fit(Mlp(p=0.0, hidden=4), mlp_data(64), 8, plan=Plan.for_target(8, 8), epochs=None, max_steps=2,
                  checkpoint_dir=ckpt, progress=False, verbose=False)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\nkeep these\n")
    with pytest.raises(ValueError, match=r"log_file '.*notes.txt' holds a line that is not one of autoaccum's"):
        autoaccum.fit(Mlp(p=0.0, hidden=4), mlp_data(64), 8, plan=Plan.for_target(8, 8), epochs=None, max_steps=4,
                      checkpoint_dir=ckpt, resume=True, log_file=notes, progress=False, verbose=False)
    assert notes.read_text() == "my notes\nkeep these\n"


def test_checkpoint_size_does_not_grow_with_the_run(tmp_path):
    """The checkpoint used to hold every step's loss (a list growing by a float a step). It holds the last
    loss now: after 1,000 steps it is the size it was after 10 (the history is in the metrics file)."""
    sizes = {}
    for steps in (10, 1000):
        directory = tmp_path / str(steps)
        result = autoaccum.fit(Mlp(p=0.0, hidden=4), mlp_data(64), 8, plan=Plan.for_target(8, 8), epochs=None,
                               max_steps=steps, checkpoint_dir=directory, progress=False, verbose=False)
        assert result.optimizer_steps == steps and len(result.losses) == steps
        sizes[steps] = (directory / "checkpoint.pt").stat().st_size
        saved = checkpoint.load_checkpoint(directory)
        assert saved["counters"] == {"steps": steps, "samples": 8 * steps, "skipped": 0,
                                     "last_loss": result.final_loss}
    assert abs(sizes[1000] - sizes[10]) <= 64, sizes  # a pickled int may take a few bytes more


# -- LR rules ------------------------------------------------------------------------------------

def _small(n: int = 128, seed: int = 0):
    model = Mlp(p=0.0, seed=seed, dtype=torch.float64)
    return model, mlp_data(n, dtype=torch.float64)


@pytest.mark.parametrize(("rule", "expected"), [("linear", 0.02), ("sqrt", 0.01 * math.sqrt(2)), ("none", 0.01)])
def test_lr_rules(rule, expected, tmp_path):
    model, data = _small()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # lr= agrees: a different one is refused
    log = tmp_path / "log.jsonl"
    result = autoaccum.fit(model, data, 64, optimizer=opt, lr=0.01, base_batch=32, lr_rule=rule,
                           plan=Plan.for_target(64, 16), progress=False, log_file=log)
    assert result.lr == pytest.approx(expected, rel=1e-15)
    assert opt.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-15)
    assert [r["lr"] for r in _records(log)] == pytest.approx([expected] * 2, rel=1e-15)


def test_lr_rule_is_not_applied_at_the_base_batch():
    model, data = _small()
    result = autoaccum.fit(model, data, 64, lr=0.01, base_batch=64, lr_rule="linear",
                           plan=Plan.for_target(64, 16), progress=False)
    assert result.lr == 0.01


def test_lr_rule_applies_on_a_first_run_with_resume_auto(tmp_path):
    # resume="auto" on an empty checkpoint_dir (a restartable job's first start) is a fresh run
    model, data = _small()
    result = autoaccum.fit(model, data, 64, lr=0.01, base_batch=32, lr_rule="linear", plan=Plan.for_target(64, 16),
                           checkpoint_dir=tmp_path / "ckpt", resume="auto", progress=False)
    assert result.plan_source == "given" and result.lr == pytest.approx(0.02)
    # and the second start resumes from the checkpoint the first one wrote
    again = autoaccum.fit(model, data, 64, lr=0.01, base_batch=32, lr_rule="linear", plan=Plan.for_target(64, 16),
                          checkpoint_dir=tmp_path / "ckpt", resume="auto", epochs=2, progress=False)
    assert again.plan_source == "checkpoint" and again.optimizer_steps == 2 * result.optimizer_steps


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_resume_true_without_a_checkpoint_is_refused_before_any_work(tmp_path, where):
    """resume=True never starts afresh silently (as Hugging Face's Trainer refuses it): the error names the
    directory and the ways out, before the probe or any step, and makes no directory."""
    model, data = _small()
    before = [p.detach().clone() for p in model.parameters()]
    directory = tmp_path / "ckpt"
    if where == "empty":
        directory.mkdir()
    with pytest.raises(ValueError, match=rf"resume=True, but checkpoint_dir '{directory}' "
                                         rf"(does not exist|holds no checkpoint.pt).*resume=False to start afresh.*"
                                         rf"resume='auto'"):
        autoaccum.fit(model, data, 64, budget="1MiB", checkpoint_dir=directory, resume=True, progress=False)
    assert directory.exists() == (where == "empty")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match=r"Invalid resume: 'yes'\. Allowed values: True, False, 'auto'"):
        autoaccum.fit(model, data, 64, checkpoint_dir=directory, resume="yes", progress=False)


def test_adam_sde_rule_scales_betas_and_eps():
    model, data = _small()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    result = autoaccum.fit(model, data, 64, optimizer=opt, base_batch=32, lr_rule="adam_sde",
                           plan=Plan.for_target(64, 16), progress=False)
    group = opt.param_groups[0]
    assert result.lr == group["lr"] == pytest.approx(0.01 * math.sqrt(2))
    assert group["betas"] == pytest.approx((0.8, 0.98)) and group["eps"] == pytest.approx(1e-8 / math.sqrt(2))


def test_warmup_values_per_step_and_the_lr_actually_used(tmp_path):
    # SGD without momentum: each step moves the weights by exactly lr_k * grad, so a loop that
    # uses the documented schedule lr * min(1, k / 4) (k = 1, 2, ...) gives the same weights
    n, target, lr, warmup = 64 * 6, 64, 0.2, 4
    model, (x, y) = _small(n)
    ref = Mlp(p=0.0, seed=0, dtype=torch.float64)
    log = tmp_path / "log.jsonl"
    autoaccum.fit(model, (x, y), target, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                  warmup_steps=warmup, plan=Plan.for_target(target, 16), progress=False, log_file=log)
    expected = [lr * min(1.0, k / warmup) for k in range(1, 7)]
    assert [r["lr"] for r in _records(log)] == pytest.approx(expected, rel=1e-15)
    for k, idx in enumerate(global_batches(n, target, 0, 1)):
        ref.zero_grad()
        cross_entropy(ref, (x[idx], y[idx])).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= expected[k] * p.grad
    assert max_abs_diff(model, ref) < 1e-12


def test_warmup_lr_is_the_same_with_an_oom(tmp_path):
    class Flaky(Mlp):
        """Runs out of memory once, at the ``fail_at``-th forward (the first micro-batch of step 2)."""

        def __init__(self, fail_at):
            super().__init__(p=0.0, dtype=torch.float64)
            self.fail_at, self.calls = fail_at, 0

        def forward(self, x):
            self.calls += 1
            if self.calls == self.fail_at:
                raise torch.OutOfMemoryError("injected")
            return super().forward(x)

    lrs = []
    for fail_at in (None, 3):
        log = tmp_path / f"{fail_at}.jsonl"
        result = autoaccum.fit(Flaky(fail_at), mlp_data(64 * 4, dtype=torch.float64), 64, lr=0.1, warmup_steps=3,
                               plan=Plan.for_target(64, 32), progress=False, log_file=log)
        assert result.oom_events == (fail_at is not None)
        lrs.append([r["lr"] for r in _records(log)])
    assert lrs[0] == lrs[1] == pytest.approx([0.1 / 3, 0.2 / 3, 0.1, 0.1], rel=1e-15)



def _cosine(optimizer, total_steps):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)


@pytest.mark.parametrize("fail_at", [None, 3])
def test_a_scheduler_factory_is_built_after_the_rule_and_stepped_once_per_optimizer_step(fail_at, tmp_path):
    """``fit(scheduler=factory)``: built with the run's total steps after the lr rule (its base lr is the rule's),
    stepped once per optimizer step, also with an OOM replay (the 3rd forward: step 2's first micro-batch). SGD
    without momentum: a full-batch loop with the same schedule gives the same weights (fp64, 1e-12). Negative
    control: the loop at the unscaled base lr differs."""
    n, target, lr = 64 * 4, 64, 0.2
    model, (x, y) = _small(n)
    calls = {"forward": 0}
    if fail_at is not None:
        def flaky(module, args):
            calls["forward"] += 1
            if calls["forward"] == fail_at:
                raise torch.OutOfMemoryError("injected")
        model.register_forward_pre_hook(flaky)
    log = tmp_path / "log.jsonl"
    result = autoaccum.fit(model, (x, y), target, optimizer=torch.optim.SGD(model.parameters(), lr=lr), base_batch=32,
                           scheduler=_cosine, plan=Plan.for_target(target, 32), progress=False, log_file=log)
    assert result.oom_events == (fail_at is not None) and result.lr == pytest.approx(2 * lr)
    for rule_lr in (2 * lr, lr):  # the rule's lr (the run), then the unscaled one (the control)
        ref = Mlp(p=0.0, seed=0, dtype=torch.float64)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=rule_lr)
        schedule, used = _cosine(ref_opt, 4), []
        for idx in global_batches(n, target, 0, 1):
            ref_opt.zero_grad()
            cross_entropy(ref, (x[idx], y[idx])).backward()
            used.append(ref_opt.param_groups[0]["lr"])
            ref_opt.step()
            schedule.step()
        if rule_lr == 2 * lr:
            assert [r["lr"] for r in _records(log)] == pytest.approx(used, rel=1e-15)
            assert max_abs_diff(model, ref) < 1e-12
        else:
            assert max_abs_diff(model, ref) > 1e-4


@pytest.mark.parametrize(("scheduler", "options", "error", "match"), [
    ("cosine", {}, TypeError, r"scheduler='cosine' is not a factory.*scheduler\(optimizer, total_steps\).*"
                              r"CosineAnnealingLR"),
    ("built", {}, TypeError, r"takes a factory, not a built CosineAnnealingLR.*unscaled lr"),
    (_cosine, {"warmup_steps": 2}, ValueError, r"warmup_steps=2 and scheduler= are two schedules.*SequentialLR"),
    (lambda opt, total: 0.5, {}, TypeError, r"returned a float; it must return a torch.optim.lr_scheduler"),
    ("other", {}, TypeError, r"returned a scheduler of another optimizer"),
])
def test_a_scheduler_that_is_not_a_factory_of_this_optimizer_is_refused_before_any_step(scheduler, options, error,
                                                                                         match):
    model, data = _small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    made = {"built": _cosine(optimizer, 4), "other": lambda opt, total: _cosine(other, total)}
    given = made.get(scheduler, scheduler) if isinstance(scheduler, str) else scheduler
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        autoaccum.fit(model, data, 64, optimizer=optimizer, scheduler=given, plan=Plan.for_target(64, 16),
                      progress=False, **options)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

# -- evaluation ----------------------------------------------------------------------------------

class _Recorder(nn.Module):
    """A linear model that records (training, rows) of every forward; in eval mode it runs out of
    memory above ``eval_cap`` rows."""

    def __init__(self, eval_cap: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 3).double()
        self.calls: list[tuple[bool, int]] = []
        self.eval_cap = eval_cap

    def forward(self, x):
        self.calls.append((self.training, x.shape[0]))
        if not self.training and self.eval_cap is not None and x.shape[0] > self.eval_cap:
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} rows in eval")
        return self.lin(x)


def _eval_run(eval_cap=None, **kwargs):
    model = _Recorder(eval_cap)
    train, held_out = mlp_data(128, dtype=torch.float64), mlp_data(40, seed=9, dtype=torch.float64)
    result = autoaccum.fit(model, train, 32, plan=Plan.for_target(32, 8), eval_data=held_out, eval_every=2,
                           epochs=None, max_steps=5, progress=False, **kwargs)
    with torch.no_grad():
        expected = F.cross_entropy(model.lin(held_out[0]), held_out[1]).item()
    return result, model, expected


def test_eval_every_n_steps_and_at_the_end():
    result, model, expected = _eval_run()
    evals = [rows for training, rows in model.calls if not training]
    # eval micro-batch 2 x 8; eval data 40 = a global batch of 32 (16 + 16) and one of 8
    assert evals == [16, 16, 8] * 3  # after steps 2 and 4, and at the end (step 5)
    assert {rows for training, rows in model.calls if training} == {8}
    assert result.eval_loss == pytest.approx(expected, rel=1e-12)
    assert result.eval_ooms == 0


def test_eval_oom_shrinks_only_the_eval_batch():
    result, model, expected = _eval_run(eval_cap=8)
    evals = [rows for training, rows in model.calls if not training]
    assert evals == [16] + [8, 8, 8, 8, 8] + [8, 8, 8, 8, 8] * 2  # halved once, then kept
    assert result.eval_ooms == 1 and result.oom_events == 0
    assert result.plan_changes == () and result.final_plan == result.plan == Plan.for_target(32, 8)
    assert {rows for training, rows in model.calls if training} == {8}
    assert result.eval_loss == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("budget, eval_ooms", [("64KiB", 0), ("18KiB", 1)])
def test_evaluation_under_an_emulated_budget_counts_what_the_device_is_sent(budget, eval_ooms):
    """An eval global batch is drawn on the host, like a training batch: 256 rows x 64 fp64 = 128 KiB,
    far above the budget, must not count (it did: an OOM in evaluation's data gathering, where no
    retry catches it, ended fit at any budget below 128 KiB). The micro-batches the device is sent do
    count: at 18 KiB an eval micro-batch of 32 rows (16 KiB) does not fit and halves once, while
    training's 16 rows fit; at 64 KiB nothing is retried."""
    torch.manual_seed(0)
    model = nn.Linear(64, 2).double()
    g = torch.Generator().manual_seed(1)
    x, ex = torch.randn(256, 64, generator=g, dtype=torch.float64), torch.randn(256, 64, generator=g,
                                                                                  dtype=torch.float64)
    y, ey = (x[:, 0] > 0).long(), (ex[:, 1] > 0).long()
    result = autoaccum.fit(model, (x, y), 256, plan=Plan.for_target(256, 16), eval_data=(ex, ey), budget=budget,
                           epochs=None, max_steps=2, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           progress=False)
    with torch.no_grad():
        expected = F.cross_entropy(model(ex), ey).item()
    assert result.eval_ooms == eval_ooms and result.oom_events == 0
    assert result.eval_loss == pytest.approx(expected, rel=1e-12)


# -- metrics file and quiet output -----------------------------------------------------------------

def test_metrics_file(tmp_path):
    model, data = _small(150)
    log = tmp_path / "metrics.jsonl"
    result = autoaccum.fit(model, data, 64, plan=Plan.for_target(64, 16), budget="64MiB", progress=False, log_file=log)
    records = _records(log)
    for record in records:
        assert {"step", "loss", "lr", "samples", "micro_batch", "accum_steps", "peak_bytes",
                "step_time_s"} <= set(record)
        assert isinstance(record["peak_bytes"], int) and record["peak_bytes"] > 0 and record["step_time_s"] > 0
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["samples"] for r in records] == [64, 128, 150]
    assert [(r["micro_batch"], r["accum_steps"]) for r in records] == [(16, 4)] * 3
    assert [r["loss"] for r in records] == list(result.losses)
    autoaccum.fit(model, data, 64, plan=Plan.for_target(64, 16), progress=False, log_file=log)
    assert len(_records(log)) == 6  # appended, not overwritten


@pytest.mark.parametrize("progress", [False, True])  # True: stderr is not a terminal under capsys
def test_quiet_apart_from_logging(progress, capsys, caplog):
    model, data = _small()
    with caplog.at_level("INFO", logger="autoaccum"):
        autoaccum.fit(model, data, 64, plan=Plan.for_target(64, 16), progress=progress)
    assert capsys.readouterr() == ("", "")
    messages = [r.getMessage() for r in caplog.records]
    assert any("batch 64 = 16 x 4 (4 micro-batches), as given" in m for m in messages)
    assert any("autoaccum fit done" in m for m in messages)


# -- data kinds ----------------------------------------------------------------------------------

class _DictData(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "label": int(self.y[i])}


def test_map_style_dataset_of_dicts_equals_the_tuple_of_tensors():
    (x, y), runs = mlp_data(150, dtype=torch.float64), []
    for data, loss_fn in [((x, y), None),
                          (_DictData(x, y), lambda m, b: F.cross_entropy(m(b["features"]), b["label"]))]:
        model = Mlp(p=0.0, dtype=torch.float64)
        result = autoaccum.fit(model, data, 64, loss_fn=loss_fn, plan=Plan.for_target(64, 16), epochs=2,
                               seed=5, progress=False)
        runs.append((result, model))
    (r1, m1), (r2, m2) = runs
    assert r1.losses == r2.losses and r2.samples_seen == 300
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))


def test_loader_of_global_batches_equals_a_sequential_loop():
    x, y = mlp_data(150, dtype=torch.float64)
    loader = DataLoader(TensorDataset(x, y), batch_size=64)  # 64, 64, 22: the last one is partial
    model, ref = Mlp(p=0.0, dtype=torch.float64), Mlp(p=0.0, dtype=torch.float64)
    result = autoaccum.fit(model, loader, 64, plan=Plan.for_target(64, 16), epochs=2, progress=False)
    assert result.optimizer_steps == 6 and result.samples_seen == 300
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(2):
        for i in range(0, 150, 64):
            opt.zero_grad()
            cross_entropy(ref, (x[i:i + 64], y[i:i + 64])).backward()
            opt.step()
    assert max_abs_diff(model, ref) < 1e-12


def test_generator_of_batches_loses_no_batch_to_the_probe():
    x, y = mlp_data(64 * 3)
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 192, 64)]
    result = autoaccum.fit(Mlp(p=0.0), iter(batches), 64, budget="64MiB", epochs=None, max_steps=10,
                           progress=False)
    assert result.plan_source == "probe"
    assert result.optimizer_steps == 3 and result.samples_seen == 192  # then the generator ran out


# -- bad input -----------------------------------------------------------------------------------

class _Spy:
    def __init__(self):
        self.calls = 0

    def __call__(self, model, batch):
        self.calls += 1
        return cross_entropy(model, batch)


def _fit_bad(data=None, target=64, **kwargs):
    spy = _Spy()
    model = kwargs.pop("model", None) or Mlp(p=0.0)
    kwargs.setdefault("plan", Plan.for_target(target, 16))
    kwargs.setdefault("progress", False)
    try:
        return autoaccum.fit(model, mlp_data(128) if data is None else data, target, loss_fn=spy, **kwargs)
    finally:
        assert spy.calls == 0  # refused before any work


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(data=(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long))), ValueError, "empty"),
    (dict(data=[]), ValueError, "empty"),
    (dict(data=mlp_data(50)), ValueError, "50 samples, fewer than one global batch of 64"),
    (dict(data=(torch.zeros(128, 6), torch.zeros(127, dtype=torch.long))), ValueError, "disagree in dim 0"),
    (dict(lr_rule="cubic", base_batch=32), ValueError, "Invalid lr_rule: 'cubic'. Allowed values: linear, sqrt"),
    (dict(base_batch=0), ValueError, "Invalid base_batch: 0. Allowed range: 1"),
    (dict(base_batch=-32), ValueError, "Invalid base_batch: -32"),
    (dict(base_batch=32.0), TypeError, "base_batch must be an int"),
    (dict(epochs=None, max_steps=None), ValueError, "give epochs= .* or max_steps="),
    (dict(epochs=0), ValueError, "Invalid epochs: 0"),
    (dict(epochs=None, max_steps=0), ValueError, "Invalid max_steps: 0"),
    (dict(epochs=1.5), TypeError, "epochs must be an int"),
    (dict(max_steps="10"), TypeError, "max_steps must be an int"),
    (dict(lr=-1.0), ValueError, "Invalid lr"),
    (dict(warmup_steps=-1), ValueError, "Invalid warmup_steps"),
    (dict(plan=Plan.for_target(32, 16)), ValueError, "plan is for target_batch 32, this run's is 64"),
    (dict(precision="fp8"), ValueError, "Invalid precision"),
    (dict(resume=True), ValueError, "resume=True needs checkpoint_dir"),
    (dict(checkpoint_every=1), ValueError, "checkpoint_every=1 needs checkpoint_dir="),
    (dict(lr_rule="sqrt"), ValueError, "lr_rule='sqrt' rescales the lr .* give base_batch="),
    (dict(eval_data=(torch.zeros(10, 6), torch.zeros(9))), ValueError, "disagree in dim 0"),
    (dict(eval_data=(torch.zeros(10, 6), torch.zeros(9)), plan=None, budget="64MiB"), ValueError, "disagree"),
    (dict(optimizer="adam"), TypeError, "optimizer must be a torch.optim.Optimizer"),
    (dict(grow="grown"), ValueError, "Invalid grow: 'grown'. Allowed values: auto, model, double, off"),
    (dict(grow="model"), ValueError, "grow='model' needs memory the guard can read: a CUDA device, or budget="),
])
def test_bad_input_is_refused_before_any_work(kwargs, error, match):
    with pytest.raises(error, match=match):
        _fit_bad(**kwargs)


def test_unwritable_checkpoint_dir(tmp_path):
    regular = tmp_path / "file"
    regular.write_text("not a directory")
    with pytest.raises(ValueError, match="Invalid checkpoint_dir: .* cannot be written"):
        _fit_bad(checkpoint_dir=regular / "ckpt")


def test_checkpoint_of_another_model_shape(tmp_path):
    directory = tmp_path / "ckpt"
    autoaccum.fit(Mlp(p=0.0), mlp_data(128), 64, plan=Plan.for_target(64, 16), checkpoint_dir=directory,
                  progress=False)
    with pytest.raises(ValueError, match=r"other shapes \(first difference: 'net\.(0|3)\.(weight|bias)'"):
        _fit_bad(model=Mlp(p=0.0, hidden=24), checkpoint_dir=directory, resume=True)


def test_checkpoint_of_another_seed_or_target(tmp_path):
    directory = tmp_path / "ckpt"
    autoaccum.fit(Mlp(p=0.0), mlp_data(128), 64, plan=Plan.for_target(64, 16), checkpoint_dir=directory,
                  progress=False, seed=1)
    with pytest.raises(ValueError, match="seed 1.*seed 2"):  # another order would repeat and skip samples
        _fit_bad(checkpoint_dir=directory, resume=True, seed=2)
    with pytest.raises(ValueError, match="target_batch 64, this run asks for 32"):
        _fit_bad(target=32, checkpoint_dir=directory, resume=True)


@pytest.mark.parametrize("given_plan", [True, False])
def test_nan_loss_stops_before_the_weights_change(given_plan, tmp_path):
    """fp32: the NaN of step 1 is found before optimizer.step(): the weights and the optimizer are as
    they were (they used to hold NaN after one AdamW step), the error names the step."""
    model = Mlp(p=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters())
    log = tmp_path / "log.jsonl"

    def nan_loss(m, batch):
        return cross_entropy(m, batch) * float("nan")

    with pytest.raises(NonFiniteError, match=r"of optimizer step 1 \(epoch 0, batch 0\); stopped before "
                                             r"optimizer.step\(\)") as info:
        autoaccum.fit(model, mlp_data(640), 64, loss_fn=nan_loss, optimizer=opt, epochs=None, max_steps=10_000,
                      plan=Plan.for_target(64, 16) if given_plan else None, budget=None if given_plan else "64MiB",
                      progress=False, log_file=log)
    assert info.value.step == 1 and isinstance(info.value, AutoAccumError)
    assert opt.state == {} or all(not s for s in opt.state.values())  # no optimizer step ran
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    assert not log.exists() or log.read_text() == ""


def test_nonfinite_skip_skips_the_step_and_counts_it(tmp_path):
    """nonfinite='skip': the step whose loss is NaN is not taken (as a GradScaler skips); the run equals a
    full-batch loop that leaves that global batch out of its optimizer steps (fp64), and says so."""
    n, target = 256, 64
    data = mlp_data(n, dtype=torch.float64)
    calls = [0]

    def nan_in_step_2(m, batch):
        calls[0] += 1
        loss = cross_entropy(m, batch)
        return loss * float("nan") if calls[0] == 5 else loss  # micro-batches 5..8 are step 2's

    model = Mlp(p=0.0, dtype=torch.float64)
    log = tmp_path / "log.jsonl"
    result = autoaccum.fit(model, data, target, loss_fn=nan_in_step_2, plan=Plan.for_target(target, 16), lr=1e-2,
                           nonfinite="skip", progress=False, log_file=log, epochs=2)
    assert result.skipped_steps == 1 and result.optimizer_steps == 8 and result.samples_seen == 2 * n
    assert [r["skipped"] for r in _records(log)] == [False, True] + [False] * 6
    assert math.isnan(result.losses[1]) and all(math.isfinite(x) for i, x in enumerate(result.losses) if i != 1)
    reference = Mlp(p=0.0, dtype=torch.float64)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for i, idx in enumerate(global_batches(n, target, seed=0, epochs=2)):
        if i == 1:
            continue  # the skipped step: no optimizer.step(), no state
        opt.zero_grad()
        cross_entropy(reference, (data[0][idx], data[1][idx])).backward()
        opt.step()
    assert max_abs_diff(model, reference) < 1e-12
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_every_step_skipped_stops_the_run():
    with pytest.raises(AutoAccumError, match=r"25 optimizer steps in a row were skipped for inf/NaN gradients "
                                             r"\(by nonfinite='skip'\)"):
        autoaccum.fit(Mlp(p=0.0), mlp_data(640), 64, loss_fn=lambda m, b: cross_entropy(m, b) * float("inf"),
                      plan=Plan.for_target(64, 64), nonfinite="skip", epochs=None, max_steps=100, progress=False)
    with pytest.raises(ValueError, match=r"Invalid nonfinite: 'ignore'. Allowed values: stop, skip"):
        autoaccum.fit(Mlp(p=0.0), mlp_data(640), 64, nonfinite="ignore")


def test_default_loss_needs_pairs():
    with pytest.raises(TaskError, match=r"needs \(inputs, targets\) batches"):
        autoaccum.fit(Mlp(p=0.0), (torch.zeros(64, 6),), 64, plan=Plan.for_target(64, 16), progress=False)


def test_an_exhausted_iterable_ends_the_run_instead_of_looping():
    def stopper(signum, frame):
        raise TimeoutError("fit looped on an exhausted iterable")

    previous = signal.signal(signal.SIGALRM, stopper)
    signal.alarm(20)
    try:
        with pytest.raises(ValueError, match="yielded no batch"):  # found before any work
            autoaccum.fit(Mlp(p=0.0), iter([]), 64, plan=Plan.for_target(64, 16), epochs=None, max_steps=5,
                          progress=False)
        x, y = mlp_data(128)
        result = autoaccum.fit(Mlp(p=0.0), iter([(x[:64], y[:64]), (x[64:], y[64:])]), 64,
                               plan=Plan.for_target(64, 16), epochs=None, max_steps=5, progress=False)
        assert result.optimizer_steps == 2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_plan_file_with_knobs_fit_does_not_apply_is_named(tmp_path):
    import json
    import warnings

    from autoaccum import fit

    x, y = torch.randn(128, 4), torch.randint(0, 2, (128,))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"kind": "autoaccum.plan", "knobs": {"saver": "none", "autocast": "bf16",
                                                                   "compile": True},
                                "plan": {"micro_batch": 32, "accum_steps": 2, "world_size": 1, "target_batch": 64}}))
    with pytest.warns(UserWarning, match=r"precision='bf16' and model=torch.compile\(model\) to train as measured"):
        fit(torch.nn.Linear(4, 2), (x, y), 64, plan=path, progress=False, max_steps=1)
    # the saver is no knob to apply by hand: fit trains on it (the plan's saver), and says nothing
    savers = tmp_path / "savers.json"
    savers.write_text(json.dumps({"kind": "autoaccum.plan", "knobs": {"saver": "checkpointing", "autocast": "fp32",
                                                                     "compile": False},
                                  "plan": {"micro_batch": 32, "accum_steps": 2, "world_size": 1, "target_batch": 64,
                                           "saver": "checkpointing"}}))
    class Blocks(torch.nn.Module):  # blocks in an nn.ModuleList: what the checkpointing saver wraps
        def __init__(self):
            super().__init__()
            self.blocks, self.head = torch.nn.ModuleList([torch.nn.Linear(4, 4)]), torch.nn.Linear(4, 2)

        def forward(self, inputs):
            return self.head(self.blocks[0](inputs))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = fit(Blocks(), (x, y), 64, plan=savers, progress=False, max_steps=1)
    assert result.plan.saver == "checkpointing"
    plain = tmp_path / "plain.json"  # a probe report or a plan without knobs: nothing to say
    plain.write_text(json.dumps({"plan": {"micro_batch": 32, "accum_steps": 2, "world_size": 1, "target_batch": 64}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(torch.nn.Linear(4, 2), (x, y), 64, plan=plain, progress=False, max_steps=1)


def test_budget_inside_an_emulated_budget_block_is_refused_before_any_work():
    """budget= off CUDA is an emulated device, and so is an emulated_budget(...) block around fit: two
    budgets for one run are refused, naming both, before the probe (the integrations refuse the same).
    The block alone (no budget=) trains: the probe plans for what that device has free."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    data = (torch.randn(128, 16), torch.randint(0, 4, (128,)))
    before = [p.detach().clone() for p in model.parameters()]
    with autoaccum.emulated_budget("8MiB"):
        with pytest.raises(TypeError, match=r"budget='2MiB' and autoaccum\.emulated_budget\(8 MiB\).*two budgets.*"
                                            r"Give one"):
            autoaccum.fit(model, data, 64, budget="2MiB", max_steps=1, epochs=None, verbose=False, progress=False)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # no work was done
        result = autoaccum.fit(model, data, 64, max_steps=1, epochs=None, verbose=False, progress=False)
    assert result.optimizer_steps == 1
