"""autoaccum.training.trackers: fit's metrics where users look -- TensorBoard event files, W&B offline runs and
MLflow file stores written by the real packages and read back, a callable and callbacks -- and bad input.

The run: TinyGPT (fp64) at target 64 planned micro 16, under an emulated budget between step 1's peak and
step 2's (AdamW's state exists from step 2 on): step 2 runs out of memory and is replayed at micro 8, so
every backend must show the OOM at step 2 and the micro-batch change with it.
"""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path

import pytest
from _fit_models import gpt, gpt_tokens, token_loss

import autoaccum
from autoaccum.plan.plan import Plan
from autoaccum.training.trackers import Reporter

pytestmark = pytest.mark.usefixtures("one_thread")

N, TARGET = 150, 64  # 64 + 64 + 22: three steps an epoch
STEPS = 3
MICRO = [16, 8, 8]
ACCUM = [4, 8, 8]
OOMS = [0, 1, 0]


@pytest.fixture(scope="module")
def tokens():
    return gpt_tokens(N)


@pytest.fixture(scope="module")
def budget(tokens):
    """Between the peaks of step 1 and step 2 at micro 16, read from a callable reporter's metrics."""
    seen: list[dict] = []
    autoaccum.fit(gpt(), tokens, TARGET, loss_fn=token_loss, plan=Plan.for_target(TARGET, 16), budget="1GiB",
                  max_steps=2, progress=False, verbose=False, report_to=seen.append)
    first, second = (m["peak_bytes"] for m in seen)
    assert first < second
    return (first + second) // 2


def _fit(tokens, budget, **options):
    return autoaccum.fit(gpt(), tokens, TARGET, loss_fn=token_loss, plan=Plan.for_target(TARGET, 16), budget=budget,
                         epochs=1, grow="off", progress=False, verbose=False, **options)


def _check(result, steps, loss, lr, micro, ooms):
    assert result.oom_events == 1 and result.optimizer_steps == STEPS
    assert steps == [1, 2, 3]
    assert loss == pytest.approx(list(result.losses), rel=1e-6)  # TensorBoard keeps float32
    assert lr == pytest.approx([1e-3] * STEPS)
    assert micro == MICRO and ooms == OOMS


def test_tensorboard_event_files_read_back_a_callable_and_a_callback_see_each_step(tokens, budget, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    calls: list[dict] = []

    class Callback:
        def __init__(self):
            self.steps, self.result = [], None

        def on_step(self, metrics):
            self.steps.append(metrics)
            metrics["loss"] = "changed"  # each target gets its own copy

        def on_end(self, result):
            self.result = result

    callback, only_end = Callback(), type("OnlyEnd", (), {"on_end": lambda self, result: calls.append(result)})()
    result = _fit(tokens, budget, report_to=["tensorboard", calls.append], report_dir=tmp_path / "tb",
                  callbacks=[callback, only_end])
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert {"train/loss", "train/lr", "train/micro_batch", "train/accum_steps", "train/ooms", "train/samples",
            "train/step_time_s", "train/peak_bytes", "train/samples_per_s"} <= set(scalars)
    _check(result, [s for s, _ in scalars["train/loss"]], [v for _, v in scalars["train/loss"]],
           [v for _, v in scalars["train/lr"]], [v for _, v in scalars["train/micro_batch"]],
           [v for _, v in scalars["train/ooms"]])
    assert [v for _, v in scalars["train/accum_steps"]] == ACCUM
    assert [v for _, v in scalars["train/samples"]] == [64, 128, 150]
    assert all(0 < v <= budget for _, v in scalars["train/peak_bytes"])
    # the callable and the callback: every step, the metrics file's record
    steps, end = calls[:STEPS], calls[STEPS:]
    assert [m["step"] for m in steps] == [1, 2, 3] and [m["loss"] for m in steps] == list(result.losses)
    assert [m["micro_batch"] for m in steps] == MICRO and [m["ooms"] for m in steps] == OOMS
    assert [m["loss"] for m in callback.steps] == ["changed"] * STEPS
    assert callback.result is result and end == [result]


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history records of an offline W&B run, read from its transaction log (``run-<id>.wandb``): a
    LevelDB-style log (a 7-byte file header, 32 KiB blocks, records with a 7-byte header: CRC32, length,
    type FULL/FIRST/MIDDLE/LAST) of ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, block = Path(path).read_bytes(), 7, 32768
    records, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            records.append(pending)
            pending = b""
    history = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return history


def test_wandb_offline_run_reads_back(tokens, budget, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = _fit(tokens, budget, report_to="wandb")
    import wandb

    assert wandb.run is None  # the run fit started is finished
    wandb.teardown()  # W&B's service writes the run's file after finish() returns: wait for it to stop
    history = [h for h in _wandb_history(tmp_path) if "train/loss" in h]
    _check(result, [h["_step"] for h in history], [h["train/loss"] for h in history],
           [h["train/lr"] for h in history], [h["train/micro_batch"] for h in history],
           [h["train/ooms"] for h in history])


def test_mlflow_file_store_reads_back_and_a_users_run_is_left_open(tokens, budget, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks file stores to opt in
    result = _fit(tokens, budget, report_to="mlflow")
    client = mlflow.tracking.MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("Default").experiment_id])
    assert run.info.status == "FINISHED" and mlflow.active_run() is None
    assert run.data.params["target_batch"] == str(TARGET) and run.data.params["micro_batch"] == "16"

    def history(name):
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))

    loss = history("train/loss")
    _check(result, [s for s, _ in loss], [v for _, v in loss], [v for _, v in history("train/lr")],
           [v for _, v in history("train/micro_batch")], [v for _, v in history("train/ooms")])
    with mlflow.start_run() as mine:  # a run the user started: fit logs into it and leaves it open
        _fit(tokens, budget, report_to=["mlflow"], max_steps=1)
        assert mlflow.active_run().info.run_id == mine.info.run_id
    assert [s for s, _ in sorted((m.step, m.value) for m in client.get_metric_history(mine.info.run_id,
                                                                                       "train/loss"))] == [1]


def test_evaluation_reaches_the_step_and_the_end(tokens, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen: list[dict] = []
    result = autoaccum.fit(gpt(), tokens, TARGET, loss_fn=token_loss, plan=Plan.for_target(TARGET, 16),
                           eval_data=tokens[:20], eval_every=2, epochs=1, progress=False, verbose=False,
                           report_to=["tensorboard", seen.append], report_dir=tmp_path)
    assert ["eval_loss" in m for m in seen] == [False, True, False]  # step 2 evaluated; the end too (below)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    evals = [(e.step, e.value) for e in events.Scalars("eval/loss")]
    assert [s for s, _ in evals] == [2, 3] and evals[1][1] == pytest.approx(result.eval_loss, rel=1e-6)


def test_only_rank_zero_reports():
    calls: list = []

    class Callback:
        def on_step(self, metrics):
            calls.append(metrics)

    for rank in (1, 2):
        reporter = Reporter(["tensorboard", calls.append], [Callback()], rank=rank)  # opens no backend
        assert not reporter.active
        reporter.step({"step": 1, "loss": 1.0})
        reporter.end(None)
        reporter.close()
    assert calls == []


def test_a_failed_run_closes_what_it_opened(tokens, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    import mlflow

    def fail(metrics):
        raise RuntimeError("the user's reporter failed")

    with pytest.raises(RuntimeError, match="reporter failed"):
        autoaccum.fit(gpt(), tokens, TARGET, loss_fn=token_loss, plan=Plan.for_target(TARGET, 16), epochs=1,
                      progress=False, verbose=False, report_to=["mlflow", fail])
    assert mlflow.active_run() is None
    client = mlflow.tracking.MlflowClient()
    [run] = client.search_runs([client.get_experiment_by_name("Default").experiment_id])
    assert run.info.status == "FAILED"


@pytest.mark.parametrize("options, error, match", [
    ({"report_to": "tensorbord"}, ValueError, r"Invalid report_to: 'tensorbord'. Allowed: 'tensorboard', 'wandb', "
                                              r"'mlflow', or a callable"),
    ({"report_to": ["wandb", 3]}, TypeError, r"report_to holds a int; each entry must be a backend name"),
    ({"report_to": {"tensorboard": "runs"}}, TypeError, r"report_to must be a backend name"),
    ({"report_to": ["mlflow", "mlflow"]}, ValueError, r"names a backend twice"),
    ({"callbacks": print}, TypeError, r"callbacks must be a list of objects with on_step"),
    ({"callbacks": [print]}, TypeError, r"has neither on_step\(metrics\) nor on_end\(result\); a function belongs "
                                        r"in report_to="),
    ({"report_dir": 3}, TypeError, r"report_dir must be a path"),
])
def test_bad_report_options_are_refused_before_any_work(tokens, options, error, match):
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        autoaccum.fit(model, tokens, TARGET, loss_fn=token_loss, progress=False, **options)
    assert all((before[k] == v).all() for k, v in model.state_dict().items())


def test_a_missing_backend_names_its_extra_before_any_work(tokens, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    probed = []
    monkeypatch.setattr("autoaccum.training.fit.probe", lambda *a, **k: probed.append(1))
    with pytest.raises(ImportError, match=r"report_to='wandb' needs the wandb package: pip install "
                                          r"'autoaccum\[wandb\]'"):
        autoaccum.fit(gpt(), tokens, TARGET, loss_fn=token_loss, progress=False, report_to="wandb")
    assert probed == []
