"""autoaccum's command line on bad input: --version, --estimate of a task drawn from data, a --task module that
fails to import, a probe cache file that is not a report. Each error names the value, where it is, and what to do."""

import importlib.metadata
import json
import re
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import autoaccum
from autoaccum.cli import EXIT_OK, EXIT_USAGE, load_task, main
from autoaccum.errors import TaskError

ROOT = Path(__file__).resolve().parents[2]
LOADER = ["probe", "--task", "_cli_tasks:from_loader", "--budget", "1MiB", "--target-batch", "64", "--no-cache"]


@pytest.fixture(autouse=True)
def _keep_sys_path(monkeypatch):
    """resolve_task puts the working directory on sys.path, and the tests put their task folder there."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def task_dir(tmp_path, monkeypatch):
    """A folder on sys.path for task modules written by a test; the modules are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("_t45_"):
            del sys.modules[name]


def _module(folder: Path, name: str, source: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


# -- --version --------------------------------------------------------------------------------------------------

def test_version_is_the_packages_in_every_place_it_is_declared(capsys):
    """``autoaccum --version`` prints ``autoaccum.__version__``; pyproject.toml declares the version again (static),
    and the installed metadata comes from it: the three must agree, or --version would lie about the install."""
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    printed = re.fullmatch(r"autoaccum (\S+) \(torch (\S+)\)\n", capsys.readouterr().out)
    assert printed is not None and printed.group(2) == torch.__version__
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert printed.group(1) == autoaccum.__version__ == declared.group(1) == importlib.metadata.version("autoaccum")


# -- --estimate ---------------------------------------------------------------------------------------------------

def test_an_estimate_of_a_task_from_data_runs_and_agrees_with_the_probe(capsys):
    """Task.from_data's samples are drawn by index (values fake tensors do not hold): --estimate died with torch's
    DataDependentOutputException. Its peaks are the probe's to 1% (the real CPU probe's counter misses the labels
    the task's collate_fn makes with torch.tensor(list): 8 bytes a sample; the estimate counts them)."""
    code, out, err = run(capsys, *LOADER, "--estimate", "--json")
    assert code == EXIT_OK, err
    estimate = json.loads(out)
    code, out, _ = run(capsys, *LOADER, "--json")
    measured = json.loads(out)
    assert estimate["is_estimate"] and not measured["is_estimate"]
    assert [c["micro_batch"] for c in estimate["candidates"]] == [c["micro_batch"] for c in measured["candidates"]]
    for e, m in zip(estimate["candidates"], measured["candidates"]):
        assert e["peak_bytes"] == pytest.approx(m["peak_bytes"], rel=1e-2)
    assert estimate["plan"] == measured["plan"]


def test_an_estimate_of_data_dependent_code_names_the_task_its_line_and_the_fix(capsys, task_dir):
    path = _module(task_dir, "_t45_gated", """
        import torch
        import torch.nn.functional as F
        import autoaccum

        def loss(model, batch):
            out = model(batch[0])
            if out.isnan().any():  # a Python bool of a tensor
                raise RuntimeError("nan")
            return F.cross_entropy(out, batch[1])

        def make_task():
            model = torch.nn.Linear(8, 4)
            return autoaccum.Task(model=model, loss_fn=loss, name="gated loss",
                                  make_batch=lambda b: (torch.randn(b, 8), torch.randint(0, 4, (b,))))
    """)
    args = ["probe", "--task", "_t45_gated:make_task", "--budget", "1MiB", "--target-batch", "8", "--no-cache"]
    code, out, err = run(capsys, *args, "--estimate")
    assert code == EXIT_USAGE and out == ""
    assert err.startswith("autoaccum: error: task '_t45_gated:make_task' ('gated loss'): the estimate cannot trace "
                          "Linear's training step (make_batch, the model, loss_fn): its code reads a tensor's value")
    assert f"at {path}:8," in err and "DataDependentOutputException: aten._local_scalar_dense" in err
    assert err.rstrip().endswith("Drop --estimate (estimate=True): a real probe runs the step and measures it")
    assert "Traceback" not in err
    # negative control: the real probe runs it, as the message says
    assert run(capsys, *args)[0] == EXIT_OK


# -- a --task module that fails ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, source, line, raised", [
    ("_t45_raises", "import os\nraise RuntimeError('no data in /data/x')\n", 2, "RuntimeError: no data in /data/x"),
    ("_t45_syntax", "import os\n\ndef make_task(:\n    pass\n", 3, "SyntaxError: invalid syntax"),
    ("_t45_needs", "import os\nimport _t45_not_installed\n", 2,
     "ModuleNotFoundError: No module named '_t45_not_installed'"),
])
def test_a_task_module_that_fails_to_import_is_named_with_its_file_and_error(capsys, task_dir, name, source, line,
                                                                             raised):
    """It gave a bare traceback (or, for a module it imports that is missing, 'is it on PYTHONPATH?' about
    the task module itself, which was there)."""
    path = _module(task_dir, name, source)
    code, out, err = run(capsys, "probe", "--task", f"{name}:make_task", "--no-cache")
    assert code == EXIT_USAGE and out == ""
    assert err.startswith(f"autoaccum: error: task '{name}:make_task': importing module '{name}' raised {raised} "
                          f"({path}:{line}). Fix the module; python -c 'import {name}' shows the whole traceback")
    with pytest.raises(TaskError) as caught:
        load_task(f"{name}:make_task")
    assert type(caught.value.__cause__).__name__ == raised.split(":")[0]  # the original, chained


def test_a_task_function_that_raises_is_named_with_its_file_and_error(capsys, task_dir):
    path = _module(task_dir, "_t45_factory", "def make_task():\n    raise KeyError('data_dir')\n")
    code, out, err = run(capsys, "probe", "--task", "_t45_factory:make_task", "--no-cache")
    assert code == EXIT_USAGE and out == ""
    assert err.startswith(f"autoaccum: error: task '_t45_factory:make_task': make_task() raised KeyError: 'data_dir' "
                          f"({path}:2). Fix make_task in {path}")
    # negative control: a module that is not there is still told apart from one that fails
    code, _, err = run(capsys, "probe", "--task", "_t45_absent:make_task", "--no-cache")
    assert code == EXIT_USAGE and "cannot import module '_t45_absent' (No module named '_t45_absent')" in err


# -- a probe cache file that is not a report --------------------------------------------------------------------

TINY = ["probe", "--task", "_cli_tasks:tiny", "--budget", "400000", "--target-batch", "64"]


@pytest.mark.parametrize("content", ['{"kind": "autoaccum.probe", oops', '{"kind": "autoaccum.probe", "version": 3}'])
def test_a_hand_edited_cache_file_is_named_replaced_with_a_word_and_kept_under_no_cache(capsys, tmp_path, content):
    cache = ["--cache-dir", str(tmp_path)]
    assert run(capsys, *TINY, *cache, "--json")[0] == EXIT_OK
    (path,) = tmp_path.glob("probe-*.json")
    path.write_text(content)
    with warnings.catch_warnings():  # --no-cache: the file is neither read nor written
        warnings.simplefilter("error")
        assert run(capsys, *TINY, *cache, "--no-cache", "--json")[0] == EXIT_OK
    assert path.read_text() == content
    with pytest.warns(UserWarning) as caught:
        code, out, _ = run(capsys, *TINY, *cache, "--json")
    assert code == EXIT_OK and json.loads(out)["source"] == "probe"
    (message,) = [str(w.message) for w in caught if "probe cache" in str(w.message)]
    assert message.startswith(f"ignoring probe cache {path}: ")
    assert message.endswith("; the probe measures again and its result replaces the file (to keep the file, move it "
                            "away, or probe with cache=False, --no-cache on the command line, which neither reads "
                            "nor writes the cache)")
    assert json.loads(path.read_text())["fingerprint"] == json.loads(out)["fingerprint"]  # replaced, as it said
