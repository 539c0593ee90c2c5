"""autoaccum.probe.estimate: an estimate of a task drawn from the user's data, and code fake tensors cannot run."""

import pytest
import torch
import torch.nn.functional as F
from _probe_models import mlp, mlp_batch, mlp_loss
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from autoaccum import Task, TaskError, probe
from autoaccum.probe.estimate import UntraceableError

KWARGS = {"target_batch": 64, "budget": "1MiB", "cache": False}


def _peaks(report) -> dict[int, tuple[int, int, int]]:
    return {c.micro_batch: (c.peak_bytes, c.fwd_bwd_peak_bytes, c.opt_peak_bytes) for c in report.candidates}


def _assert_estimate_matches(task: Task) -> None:
    estimate, measured = probe(task, **KWARGS, estimate=True), probe(task, **KWARGS)
    assert estimate.is_estimate and not measured.is_estimate
    assert estimate.max_fitting_micro_batch == measured.max_fitting_micro_batch
    assert [c.micro_batch for c in estimate.candidates] == [c.micro_batch for c in measured.candidates]
    for size, peaks in _peaks(measured).items():
        assert _peaks(estimate)[size] == pytest.approx(peaks, rel=1e-3), size


def test_an_estimate_of_a_task_from_a_loader_draws_its_real_samples():
    """Task.from_data draws samples by reading indices (``.item()``), which fake tensors cannot: the estimate
    died with torch's DataDependentOutputException. The samples are drawn for real, the step is faked, and the
    peaks are the measured ones (the same tolerance as any estimate: the fake optimizer's scalars)."""
    x, y = mlp_batch()(40)
    loader = torch.utils.data.DataLoader(list(zip(x, y)), batch_size=16, shuffle=True)
    _assert_estimate_matches(Task.from_data(mlp(), mlp_loss, loader))
    _assert_estimate_matches(Task.from_data(mlp(), mlp_loss, (x, y)))  # tensors: gathered by index too


def test_an_estimate_of_variable_length_data_draws_its_rows_at_each_length():
    from helpers import pad_rows, padded_token_loss

    from autoaccum.demo import TinyGPT

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, 64, (int(n),), generator=g)} for n in [9] * 12 + [17] * 6 + [33] * 2]
    loader = torch.utils.data.DataLoader(rows, batch_size=4, collate_fn=pad_rows)
    torch.manual_seed(0)
    task = Task.from_data(TinyGPT(vocab_size=64, seq_len=32, dim=16, layers=1, heads=2), padded_token_loss, loader)
    kwargs = {"target_batch": 16, "budget": "64MiB", "cache": False}
    estimate, measured = probe(task, **kwargs, estimate=True), probe(task, **kwargs)
    assert estimate.lengths is not None and {c.length for c in estimate.candidates} >= {9, 33}
    real = {(c.micro_batch, c.length): c.peak_bytes for c in measured.candidates}
    shared = [c for c in estimate.candidates if (c.micro_batch, c.length) in real]
    assert shared and all(c.peak_bytes == pytest.approx(real[c.micro_batch, c.length], rel=1e-3) for c in shared)


def _reads_a_value(model, batch):
    out = model(batch[0])
    if out.abs().max() > 1e6:  # a Python bool of a tensor: its value
        raise RuntimeError("diverged")
    return F.cross_entropy(out, batch[1])


def _masks_rows(model, batch):
    keep = batch[1] >= 0  # a boolean index: as many rows as the data says
    return F.cross_entropy(model(batch[0])[keep], batch[1][keep])


@pytest.mark.parametrize("loss_fn, torch_error, words", [
    (_reads_a_value, DataDependentOutputException, "reads a tensor's value"),
    (_masks_rows, DynamicOutputShapeException, "makes a tensor whose shape depends on the values"),
])
def test_code_that_needs_the_datas_values_gets_a_clear_error_naming_the_line_and_the_fix(loss_fn, torch_error, words):
    task = Task(model=mlp(), loss_fn=loss_fn, make_batch=mlp_batch())
    with pytest.raises(UntraceableError) as caught:
        probe(task, **KWARGS, estimate=True)
    message = str(caught.value)
    assert isinstance(caught.value, TaskError) and isinstance(caught.value.__cause__, torch_error)
    assert message.startswith("the estimate cannot trace Sequential's training step (make_batch, the model, "
                              "loss_fn): its code " + words)
    assert f"{__file__}:" in message and torch_error.__name__ in message
    assert message.endswith("Drop --estimate (estimate=True): a real probe runs the step and measures it")
    # negative control: the real probe runs the same code (the message's advice holds)
    assert probe(task, **KWARGS).max_fitting_micro_batch > 1
