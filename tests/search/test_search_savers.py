"""The search's saver knob is the memory saver (autoaccum.memory.savers): a trial with a saver runs the
exact saver (the gradients of the step without it, BatchNorm statistics updated once, the same dropout
masks), the search picks among savers and its plan carries the winner's (``Plan.saver``), plan files
written before (``"checkpointing": true`` among their knobs) still load, and a search plan file made for
another model is refused as a probe report is."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
from test_search import BUDGET, FAST, QUICK, TARGET, small_task
from torch import nn

import autoaccum
from autoaccum import Knobs
from autoaccum.demo import TinyGPT
from autoaccum.plan.task import Task
from autoaccum.probe.report import model_fingerprint
from autoaccum.search import format_search, read_plan_file, search
from autoaccum.search.knobs import COMPILE_WITH_SAVER
from autoaccum.search.space import SearchSpace
from autoaccum.search.study import _sample_knobs
from autoaccum.search.throughput import measure

optuna = pytest.importorskip("optuna")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread
TIGHT = {"rtol": 1e-12, "atol": 1e-14}


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.linear, self.drop = nn.BatchNorm1d(dim), nn.Linear(dim, dim), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.linear(self.norm(x))))


class BatchNormNet(nn.Module):
    """Blocks with BatchNorm (running statistics) and dropout in an ``nn.ModuleList``: what the saver checkpoints."""

    def __init__(self, dim: int = 6, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (b,), generator=g)


class Recording(torch.optim.SGD):
    """SGD that keeps, at each ``step()``, the accumulated gradients and the model's buffers as they are then."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model.parameters(), lr=0.1)
        self.model, self.seen = model, []

    def step(self, closure=None):  # type: ignore[override]
        self.seen.append(({n: p.grad.clone() for n, p in self.model.named_parameters()},
                          {n: b.clone() for n, b in self.model.named_buffers()}))
        return super().step(closure)


def _trial(saver: str) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """What a search trial on ``saver`` steps: micro 4 x 3 for a batch of 12, from the same weights, RNG
    and samples every time (fp64)."""
    torch.manual_seed(0)
    model = BatchNormNet().double()
    optimizer = Recording(model)
    task = Task(model=model, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), make_batch=_batch)
    torch.manual_seed(7)  # the dropout masks: drawn from here in every trial
    m = measure(task, 12, 4, Knobs(saver=saver), optimizer=optimizer, **FAST)
    assert m.ok, m
    return optimizer.seen


def test_a_trial_on_the_checkpointing_saver_is_the_step_without_it():
    """fp64: the gradients of every optimizer step (dropout included) equal the trial without the saver's,
    and BatchNorm's running statistics are updated once per forward: three micro-batches, three updates."""
    plain, saver = _trial("none"), _trial("checkpointing")
    assert len(plain) == len(saver) == FAST["warmup_steps"] + FAST["measure_steps"]
    for (want_grads, want_buffers), (grads, buffers) in zip(plain, saver):
        for name, g in want_grads.items():
            torch.testing.assert_close(grads[name], g, **TIGHT, msg=name)
        for name, b in want_buffers.items():
            torch.testing.assert_close(buffers[name], b, **TIGHT, msg=name)
    assert [int(b["blocks.0.norm.num_batches_tracked"]) for _, b in saver] == [3, 6, 9, 12]


def test_negative_control_plain_checkpoint_in_a_trial_updates_batchnorm_twice(monkeypatch):
    """What the search's own checkpointing did (plain ``torch.utils.checkpoint``, no buffers put back around
    the recomputation): the statistics are updated again in backward, and the test above would fail."""
    from autoaccum.memory import savers

    plain = _trial("none")
    monkeypatch.setattr(savers, "_context_fn", lambda module: (lambda: (contextlib.nullcontext(),
                                                                         contextlib.nullcontext())))
    saver = _trial("checkpointing")
    assert int(saver[0][1]["blocks.0.norm.num_batches_tracked"]) == 6  # twice per micro-batch
    assert not torch.allclose(saver[0][1]["blocks.0.norm.running_mean"], plain[0][1]["blocks.0.norm.running_mean"])


def _saver_study() -> tuple[optuna.storages.InMemoryStorage, str]:
    """A study whose first trials are micro 16 on both savers: 16 does not fit without a saver under BUDGET,
    and fits on checkpointing (the enqueued trials run before the search's seeds and sampled trials)."""
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, study_name="savers", direction="maximize")
    for saver in ("checkpointing", "none"):
        study.enqueue_trial({"micro_batch_index": 1, "saver": saver})
    return storage, "savers"


@pytest.fixture(scope="module")
def saver_search():
    task = small_task()
    storage, name = _saver_study()
    space = SearchSpace(micro_batches=(8, 16), saver=("none", "checkpointing"), autocast=("fp32",))
    result = search(task, TARGET, n_trials=4, budget=BUDGET, space=space, storage=storage, study_name=name,
                    patience=None, **QUICK)
    return task, result


def test_the_search_picks_among_savers_and_its_plan_carries_the_saver(saver_search):
    _, result = saver_search
    outcome = {(t.plan.micro_batch, t.knobs.saver): t.status for t in result.trials}
    assert outcome[(16, "checkpointing")] == "ok" and outcome[(16, "none")] == "oom"  # the saver lets 16 fit
    assert outcome[(8, "none")] == "ok"
    for t in result.trials:  # a trial's plan is with its saver
        assert t.plan.saver == t.knobs.saver and t.plan.target_batch == TARGET
    assert result.plan.saver == result.knobs.saver
    assert result.plan_file()["plan"].get("saver", "none") == result.knobs.saver
    assert result.plan_file()["knobs"]["saver"] == result.knobs.saver and "checkpointing" not in result.knobs.to_dict()
    text = format_search(result)
    assert "fp32 + checkpointing" in text  # the table names the saver of every trial on one
    winner_line = next(line for line in text.splitlines() if line.startswith("winner: "))
    assert winner_line.startswith(f"winner: {result.plan.describe()} · fp32 · ")  # ends "with checkpointing" there


def test_fit_trains_on_the_saver_of_the_search_plan_file(saver_search, tmp_path):
    task, result = saver_search
    with_saver = result.plan.with_saver("checkpointing").with_micro_batch(16)  # whatever won: the saver's plan
    knobs = {**result.knobs.to_dict(), "saver": "checkpointing"}
    doc = {**result.plan_file(), "plan": with_saver.to_dict(), "knobs": knobs}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    assert read_plan_file(path) == (with_saver, Knobs(saver="checkpointing"))
    fitted = autoaccum.fit(task.model, iter([task.batch(TARGET)]), TARGET, loss_fn=task.loss_fn, plan=path,
                           epochs=None, max_steps=1, progress=False)
    assert fitted.plan == with_saver and fitted.plan.saver == "checkpointing" and fitted.plan_source == "given"


def test_compile_is_not_sampled_on_a_saver_and_not_run_with_one():
    space = {"saver": ["none", "checkpointing"], "autocast": ["fp32"], "compile": [False, True]}
    chosen = {"saver": "checkpointing", "autocast": "fp32", "compile": True}
    assert _sample_knobs(optuna.trial.FixedTrial(chosen), space) == Knobs(saver="checkpointing")
    assert _sample_knobs(optuna.trial.FixedTrial({**chosen, "saver": "none"}), space) == Knobs(compile=True)
    m = measure(small_task(), TARGET, 8, Knobs(saver="checkpointing", compile=True), budget=BUDGET, **FAST)
    assert (m.status, m.note) == ("failed", COMPILE_WITH_SAVER)


# -- the model the plan was made for ------------------------------------------------------------------

def test_a_search_plan_file_of_another_model_is_refused(saver_search, tmp_path):
    task, result = saver_search
    assert result.model_fingerprint == model_fingerprint(task.model)
    path = result.save(tmp_path / "plan.json")
    assert json.loads(path.read_text())["model_fingerprint"] == result.model_fingerprint
    other = TinyGPT(vocab_size=64, seq_len=16, dim=32, layers=3, heads=2)  # one block more: another model
    says = (r"plan= is a search result.* measured on another model \(TinyGPT: .*\) than the one training "
            r"\(TinyGPT: .*\); .* Search this model again \(or drop plan= to probe it\)")
    for source in (path, str(path), result, result.plan_file(), result.to_dict()):
        with pytest.raises(ValueError, match=says):
            autoaccum.fit(other, task.batch(TARGET), TARGET, loss_fn=task.loss_fn, plan=source, progress=False)
    with pytest.raises(ValueError, match=says):
        autoaccum.OOMGuard(other, torch.optim.SGD(other.parameters(), lr=0.1), plan=path)
    # its bare plan is the caller's explicit choice and passes; the file passes for the model it was made for
    assert autoaccum.OOMGuard(other, torch.optim.SGD(other.parameters(), lr=0.1), plan=result.plan).plan == result.plan
    assert autoaccum.OOMGuard(task.model, torch.optim.SGD(task.model.parameters(), lr=0.1), plan=path).plan == \
        result.plan


def test_a_probe_report_of_another_model_is_refused_by_search():
    task = small_task()
    report = autoaccum.probe(small_task(1), target_batch=TARGET, budget=BUDGET)  # the same model: accepted
    other = Task(model=TinyGPT(vocab_size=64, seq_len=16, dim=32, layers=3, heads=2), loss_fn=task.loss_fn,
                 make_batch=task.make_batch)
    with pytest.raises(ValueError, match=r"report= is a probe report measured on another model"):
        search(other, TARGET, report=report, n_trials=1, **QUICK)
    assert search(task, TARGET, report=report, n_trials=1, **QUICK).model_fingerprint == report.model_fingerprint
