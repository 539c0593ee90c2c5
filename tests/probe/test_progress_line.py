"""autoaccum.probe.progress_line: the probe's line on a terminal (fit's probe and ``autoaccum probe``), and nothing
with ``progress=False``, ``verbose=False`` or off a terminal."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
from _fit_models import gpt, gpt_tokens, token_loss
from _probe_models import mlp, mlp_batch, mlp_loss

import autoaccum
from autoaccum.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _updates(text: str) -> list[str]:
    """The states the line went through (each write starts with carriage return + erase line)."""
    return [part for part in text.split("\r\x1b[K") if part]


def _sizes(update: str) -> list[tuple[int, str]]:
    return [(int(m[1]), m[2]) for m in re.finditer(r"(\d+) (fits|over budget|out of memory)", update)]


def test_the_line_shows_each_size_as_it_is_measured_and_is_cleared(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    report = autoaccum.probe(model=mlp(), loss_fn=mlp_loss, make_batch=mlp_batch(), target_batch=64,
                             budget=400_000, progress=True)
    text = terminal.getvalue()
    assert text.endswith("\r\x1b[K")  # cleared: the report follows on a clean line
    updates = _updates(text)
    assert updates[0] == "autoaccum probe · measuring micro-batch 1 · 0 s"
    said = {"ok": "fits", "over_budget": "over budget", "oom": "out of memory"}
    assert _sizes(updates[-1]) == [(c.micro_batch, said[c.status]) for c in report.candidates]
    starting = [int(m[1]) for u in updates for m in [re.search(r"measuring micro-batch (\d+)", u)] if m]
    assert starting == [c.micro_batch for c in report.candidates]  # each size named before its passes


@pytest.mark.parametrize("stream, progress", [(Terminal, False), (io.StringIO, True)], ids=["off", "not-a-terminal"])
def test_nothing_without_progress_or_off_a_terminal(monkeypatch, stream, progress):
    out = stream()
    monkeypatch.setattr(sys, "stderr", out)
    autoaccum.probe(model=mlp(), loss_fn=mlp_loss, make_batch=mlp_batch(), target_batch=64, budget=400_000,
                    progress=progress)
    assert out.getvalue() == ""


@pytest.mark.parametrize("options, shown", [({}, True), ({"progress": False}, False), ({"verbose": False}, False)])
def test_fit_shows_its_probe_unless_quiet(monkeypatch, options, shown):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    result = autoaccum.fit(gpt(), gpt_tokens(64), 32, loss_fn=token_loss, budget="1GiB", max_steps=1, **options)
    assert result.plan_source == "probe"
    probe_lines = [u for u in _updates(terminal.getvalue()) if u.startswith("autoaccum probe")]
    assert bool(probe_lines) is shown
    if shown:
        assert _sizes(probe_lines[-1]) == [(c.micro_batch, "fits") for c in result.probe.candidates]


def test_cli_shows_it_on_a_terminal_and_keeps_stdout_for_the_result(monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code = main(["probe", "--task", "_cli_tasks:tiny", "--budget", "400000", "--target-batch", "64", "--no-cache",
                 "--json"])
    assert code == 0
    json.loads(capsys.readouterr().out)  # stdout: the document alone
    assert any(u.startswith("autoaccum probe: 1 fits") for u in _updates(terminal.getvalue()))
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main(["probe", "--task", "_cli_tasks:tiny", "--budget", "400000", "--target-batch", "64", "--no-cache",
                 "-v"]) == 0
    assert "autoaccum probe:" not in quiet.getvalue()  # -v logs each measurement instead
