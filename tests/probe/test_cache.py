"""autoaccum.probe.cache: probe results reused by fingerprint; corrupt or foreign files ignored with a warning."""

import json
from pathlib import Path

import pytest
import torch
from _probe_models import mlp, mlp_batch, mlp_loss

import autoaccum
from autoaccum import probe
from autoaccum.probe.cache import default_cache_dir, fingerprint


class CountingLoss:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model, batch):
        self.calls += 1
        return mlp_loss(model, batch)


def _probe(tmp_path, loss_fn=mlp_loss, **kwargs):
    args = {"model": mlp(), "loss_fn": loss_fn, "make_batch": mlp_batch(), "budget": 400_000,
            "target_batch": 16, "cache": True, "cache_dir": tmp_path}
    return probe(**{**args, **kwargs})


def _only_file(folder: Path) -> Path:
    files = [p for p in folder.iterdir()]
    assert len(files) == 1, files
    return files[0]


def test_a_second_probe_with_the_same_fingerprint_runs_no_step(tmp_path):
    loss = CountingLoss()
    first = _probe(tmp_path, loss)
    calls = loss.calls
    assert first.source == "probe" and calls == first.probe_steps - first.probe_ooms
    path = _only_file(tmp_path)
    assert path.name.startswith("probe-") and path.suffix == ".json"
    assert json.loads(path.read_text())["fingerprint"] == first.fingerprint

    second = _probe(tmp_path, loss)
    assert loss.calls == calls  # not one training step
    assert second.source == "cache"
    assert second.plan == first.plan and second.candidates == first.candidates and second.model == first.model
    assert second.fingerprint == first.fingerprint


def test_without_cache_it_neither_reads_nor_writes(tmp_path):
    _probe(tmp_path)
    loss = CountingLoss()
    report = _probe(tmp_path, loss, cache=False)
    assert report.source == "probe" and loss.calls > 0
    fresh = tmp_path / "fresh"
    _probe(fresh, cache=False)
    assert not fresh.exists()


@pytest.mark.parametrize("change", [{"budget": 500_000}, {"headroom": 0.2}, {"target_batch": 8},
                                    {"model": mlp(hidden=48)}, {"estimate": True},
                                    {"optimizer": lambda params: torch.optim.SGD(params, lr=0.1)}])
def test_a_different_fingerprint_is_measured_anew(tmp_path, change):
    _probe(tmp_path)
    loss = CountingLoss()
    report = _probe(tmp_path, loss, **change)
    assert report.source == "probe" and loss.calls > 0
    assert len(list(tmp_path.iterdir())) == 2


def test_the_fingerprint_is_stable_and_covers_what_memory_depends_on():
    def fp(model=None, **overrides):
        task = autoaccum.Task(model=model or mlp(), loss_fn=mlp_loss, make_batch=mlp_batch())
        args = {"device": torch.device("cpu"), "capacity_bytes": 2**34, "budget_bytes": 2**20, "headroom": 0.1,
                "target_batch": 256, "world_size": 1, "upper": 256, "estimate": False}
        return fingerprint(task, None, **{**args, **overrides})

    base = fp()
    assert base == fp() and len(base) == 64
    assert fp(capacity_bytes=2**35) == base  # host RAM varies from run to run; on CPU it is not part of it
    assert fp(model=mlp().double()) != base
    assert fp(model=mlp(in_dim=33)) != base
    for change in ({"budget_bytes": 2**21}, {"headroom": 0.2}, {"target_batch": 128}, {"world_size": 2},
                   {"upper": 64}, {"estimate": True}):
        assert fp(**change) != base, change


def test_two_lambda_factories_do_not_collide_and_the_same_one_hits(tmp_path):
    """Every lambda's __qualname__ is ``<lambda>``: the fingerprint used to name a factory by it, so a
    probe with an SGD lambda reused the plan measured for an AdamW lambda (whose state is twice the
    weights). The fingerprint now holds what the factory builds: class and group options."""
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    adamw = lambda params: torch.optim.AdamW(params, lr=0.1)  # noqa: E731
    sgd_other_lr = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
    first = _probe(tmp_path, optimizer=sgd)
    for other in (adamw, sgd_other_lr):
        loss = CountingLoss()
        report = _probe(tmp_path, loss, optimizer=other)
        assert report.source == "probe" and loss.calls > 0 and report.fingerprint != first.fingerprint
    assert len(list(tmp_path.iterdir())) == 3
    loss = CountingLoss()
    again = _probe(tmp_path, loss, optimizer=sgd)  # the same lambda: a hit, not one step
    assert again.source == "cache" and loss.calls == 0 and again.fingerprint == first.fingerprint
    # an optimizer instance is described the same way: momentum (a buffer per parameter) changes the key
    task = autoaccum.Task(model=mlp(), loss_fn=mlp_loss, make_batch=mlp_batch())
    args = {"device": torch.device("cpu"), "capacity_bytes": 2**34, "budget_bytes": 2**20, "headroom": 0.1,
            "target_batch": 256, "world_size": 1, "upper": 256, "estimate": False}
    plain = fingerprint(task, torch.optim.SGD(task.model.parameters(), lr=0.1), **args)
    assert plain == fingerprint(task, torch.optim.SGD(task.model.parameters(), lr=0.1), **args)
    assert plain != fingerprint(task, torch.optim.SGD(task.model.parameters(), lr=0.1, momentum=0.9), **args)


@pytest.mark.parametrize("content", ["{not json", "[1, 2, 3]", '{"kind": "autoaccum.probe"}', "\xff\xfe"])
def test_a_corrupt_cache_file_is_ignored_with_a_warning(tmp_path, content):
    _probe(tmp_path)
    path = _only_file(tmp_path)
    path.write_text(content, encoding="latin-1")
    loss = CountingLoss()
    with pytest.warns(UserWarning, match=f"ignoring probe cache {path}"):
        report = _probe(tmp_path, loss)
    assert report.source == "probe" and loss.calls > 0
    assert json.loads(path.read_text())["fingerprint"] == report.fingerprint  # rewritten, valid again


def test_a_cache_file_of_another_fingerprint_is_ignored_with_a_warning(tmp_path):
    report = _probe(tmp_path)
    path = _only_file(tmp_path)
    data = json.loads(path.read_text())
    data["fingerprint"] = "0" * 64
    data["probe_steps"], data["candidates"] = 999_999, []  # a lie it must not tell
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="written for another task or device"):
        again = _probe(tmp_path)
    assert again.source == "probe" and again.probe_steps != 999_999
    assert [c.micro_batch for c in again.candidates] == [c.micro_batch for c in report.candidates]



def test_a_hand_edited_cache_whose_fitting_peak_exceeds_the_budget_is_ignored(tmp_path):
    """A cache file edited to say a micro-batch fits with a peak above the usable budget was printed as
    "peak 30.8 MiB of 4 MiB", exit 0, and planned from. No measurement says so: ignored, measured again."""
    report = _probe(tmp_path)
    path = _only_file(tmp_path)
    data = json.loads(path.read_text())
    fitting = next(c for c in data["candidates"] if c["status"] == "ok")
    fitting["peak_bytes"] = 10 * report.usable_bytes
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=rf"micro-batch {fitting['micro_batch']} is marked as fitting with a peak of "
                                         r".* above the .* usable \(not a probe's result\).*--no-cache"):
        again = _probe(tmp_path)
    assert again.source == "probe" and again.probe_steps > 0
    assert _probe(tmp_path).source == "cache"  # the control: the file it wrote is reused

def test_a_cache_file_of_another_version_is_ignored_with_a_warning(tmp_path):
    _probe(tmp_path)
    path = _only_file(tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "version": 0}))
    with pytest.warns(UserWarning, match="version 0 is not supported"):
        assert _probe(tmp_path).source == "probe"


def test_a_cache_that_cannot_be_written_only_warns(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match="could not write the probe cache"):
        report = _probe(blocker / "cache")
    assert report.source == "probe"


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "autoaccum"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "autoaccum"
