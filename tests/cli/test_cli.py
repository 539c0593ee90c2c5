"""autoaccum probe: the command line (human table, --json, exit codes, --task, cache, plot)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autoaccum
from autoaccum.cli import EXIT_DOES_NOT_FIT, EXIT_OK, EXIT_USAGE, main
from autoaccum.probe.report import REPORT_VERSION

TESTS = Path(__file__).resolve().parents[1]
TINY = ["probe", "--task", "_cli_tasks:tiny", "--budget", "400000", "--target-batch", "64"]
SENTINEL_WALL_S = 12345.0  # a probe wall time no real probe of TINY takes: marks an entry written by a test


@pytest.fixture(autouse=True)
def _keep_sys_path(monkeypatch):
    """resolve_task puts the working directory on sys.path; keep that out of the other tests."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_is_one_document_on_stdout(capsys):
    code, out, _ = run(capsys, *TINY, "--json", "--no-cache", "-v")
    assert code == EXIT_OK
    doc = json.loads(out)  # nothing but the document on stdout
    assert doc["version"] == REPORT_VERSION == 3 and doc["kind"] == "autoaccum.probe"
    assert doc["device"] == "cpu" and doc["budget_bytes"] == 400_000 and doc["meter"] == "tracked"
    assert doc["is_estimate"] is False and doc["source"] == "probe"
    assert doc["candidates"] and {"micro_batch", "status", "peak_bytes", "step_time_s", "samples_per_s"} <= set(
        doc["candidates"][0])
    assert {"base_bytes", "per_sample_bytes", "opt_peak_bytes", "residual"} <= set(doc["model"])
    plan = doc["plan"]
    assert plan["target_batch"] == 64 and plan["world_size"] == 1
    assert plan["micro_batch"] * plan["accum_steps"] >= 64
    # (-v's logs on stderr are checked in a subprocess: pytest's own log handlers catch them here)


def test_human_output_is_a_table_and_one_plan_line(capsys):
    code, out, _ = run(capsys, *TINY, "--no-cache")
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[0] == "autoaccum probe · cpu (cpu) · fp32 · measured by counting tensor bytes"
    assert lines[1].startswith("budget 391 KiB (given), 10% kept free: plans for 352 KiB")
    assert any(line.split() == ["micro-batch", "status", "peak", "forward/backward", "optimizer", "step", "s", "per",
                                "pass", "samples/s"] for line in lines)
    assert any(line.startswith("memory: ") and " per sample (the optimizer step needs " in line for line in lines)
    assert any(line.startswith("probe: ") and " forward/backward passes and 2 optimizer steps in " in line
               and line.endswith(" s, none ran out of memory") for line in lines)
    last = lines[-1]
    assert last.startswith("batch 64 = ") and " micro-batch" in last and _adds_up(last.split(" = ")[1].split(" (")[0])
    assert " samples/s · peak " in last and last.endswith(" of 391 KiB")
    # no jargon in the default output: the details are in --json and in -v's debug lines
    for word in ("residual", "token-units", "accum ", "fwd/bwd", "meter", "usable", "1 steps", "OOMs"):
        assert word not in out.replace("autoaccum probe", ""), word


def _adds_up(expression: str) -> int:
    """The value of a plan label's sum (``37 x 4 + 36 x 3``)."""
    return sum(eval(term.replace(" x ", " * ")) for term in expression.split(" + "))  # digits only


def test_estimate_says_so(capsys):
    code, out, _ = run(capsys, *TINY, "--no-cache", "--estimate")
    assert code == EXIT_OK
    assert "ESTIMATE on fake cpu tensors" in out.splitlines()[0]
    # no step ran: no times, no samples/s, no step count (issue 11)
    assert "samples/s" not in out and "pass s" not in out and "passes" not in out and "training steps" not in out
    assert any(line.startswith("estimate: ") and "sizes on fake tensors" in line for line in out.splitlines())
    code, out, _ = run(capsys, *TINY, "--no-cache", "--estimate", "--json")
    doc = json.loads(out)
    assert doc["is_estimate"] is True and doc["meter"] == "fake"


def test_the_default_is_the_demo(capsys):
    code, out, _ = run(capsys, "probe", "--budget", "12MiB", "--target-batch", "16", "--no-cache", "--json")
    assert code == EXIT_OK
    doc = json.loads(out)
    assert doc["plan"]["target_batch"] == 16 and doc["device"] == "cpu"
    fitting = [c["micro_batch"] for c in doc["candidates"] if c["status"] == "ok"]
    assert 1 < max(fitting) < 16  # 12 MiB is too small for 16 demo sequences at once


def test_does_not_fit_exits_3_with_needed_and_available_bytes(capsys):
    code, out, err = run(capsys, *TINY, "--no-cache", "--budget", "10KiB")
    assert code == EXIT_DOES_NOT_FIT == 3
    assert out == ""
    assert "a micro-batch of 1 does not fit: needs at least " in err and "available 9 KiB" in err
    code, out, err = run(capsys, *TINY, "--no-cache", "--budget", "10KiB", "--json")
    assert code == EXIT_DOES_NOT_FIT
    doc = json.loads(out)
    assert doc["error"] == "does_not_fit" and doc["version"] == REPORT_VERSION
    assert doc["needed_bytes"] > doc["available_bytes"] == 9216
    assert doc["suggestions"]


@pytest.mark.parametrize("task, message", [
    ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
    ("_cli_tasks:missing", "module '_cli_tasks' has no callable 'missing'"),
    ("_cli_tasks:CONSTANT", "module '_cli_tasks' has no callable 'CONSTANT'"),
    ("_cli_tasks", "expected 'module:function'"),
    (":tiny", "expected 'module:function'"),
    ("_cli_tasks:not_a_task", "not_a_task() returned int, expected autoaccum.Task"),
    ("_cli_tasks:bad_loss", "loss_fn must return a scalar tensor"),
    ("_cli_tasks:wrong_batch", "make_batch(1) returned a batch of 2 samples"),
    ("_cli_tasks:frozen", "no trainable parameters"),
    ("_cli_tasks:half_model", "the model's parameters are torch.float16 and the batch holds torch.float32 tensors"),
    ("_cli_tasks:swapped_loss", "the loss function called the batch (tuple) as a model"),
])
def test_a_bad_task_exits_2_with_a_message(capsys, task, message):
    code, out, err = run(capsys, "probe", "--task", task, "--no-cache", "--budget", "1MiB")
    assert code == EXIT_USAGE == 2
    assert out == ""
    assert err.startswith("autoaccum: error: ") and message in err


@pytest.mark.parametrize("args, message", [
    (["--budget", "eight"], "Invalid budget 'eight'"),
    (["--budget", "0"], "must be at least 1 byte"),
    (["--budget=-8GiB"], "Invalid budget '-8GiB'"),
    (["--headroom", "1"], "Invalid headroom: 1.0. Allowed range: 0 <= headroom < 1"),
    (["--headroom", "-0.5"], "Invalid headroom: -0.5"),
    (["--headroom", "lots"], "Invalid headroom: 'lots'. Allowed range: 0 <= headroom < 1"),
    (["--target-batch", "0"], "invalid value 0: allowed range 1 ~ any positive int"),
    (["--target-batch", "2.5"], "invalid int value: '2.5'"),
])
def test_bad_options_exit_2_naming_the_value(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(["probe", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("budget", ["8 GiB", "8GB", "8589934592"])
def test_budget_spellings(capsys, budget):
    code, out, _ = run(capsys, "probe", "--task", "_cli_tasks:tiny", "--budget", budget, "--target-batch", "4",
                       "--no-cache", "--json")
    assert code == EXIT_OK
    assert json.loads(out)["budget_bytes"] == {"8 GiB": 8 * 2**30, "8GB": 8 * 10**9, "8589934592": 8589934592}[budget]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_a_usage_error(capsys):
    code, _, err = run(capsys, *TINY, "--no-cache", "--device", "cuda")
    assert code == EXIT_USAGE and "CUDA is not available here" in err and "Use --device='cpu'" in err


@pytest.mark.parametrize("device", ["banana", "cuda:99"])
def test_an_unknown_device_is_a_usage_error_without_a_traceback(capsys, device):
    code, out, err = run(capsys, *TINY, "--no-cache", "--device", device)
    assert code == EXIT_USAGE and out == ""
    assert err.startswith("autoaccum: error: Invalid --device: ") and "Traceback" not in err


def test_cache_reused_unless_no_cache(capsys, tmp_path):
    cache = ["--cache-dir", str(tmp_path)]
    code, out, _ = run(capsys, *TINY, *cache, "--json")
    first = json.loads(out)
    assert code == EXIT_OK and first["source"] == "probe"
    assert len(list(tmp_path.glob("probe-*.json"))) == 1
    code, out, _ = run(capsys, *TINY, *cache, "--json")
    second = json.loads(out)
    assert second["source"] == "cache" and second["candidates"] == first["candidates"]
    code, out, _ = run(capsys, *TINY, *cache)
    assert "from the cache: measured earlier for this model, device and budget (--refresh measures again)" \
        in out.splitlines()[1]
    code, out, _ = run(capsys, *TINY, *cache, "--no-cache", "--json")
    assert json.loads(out)["source"] == "probe"
    # --no-cache neither reads nor writes; --refresh measures again and replaces the cached entry (issue 11:
    # a noisy plan frozen in the cache used to stay until the file was deleted by hand)
    (path,) = tmp_path.glob("probe-*.json")
    stored = json.loads(path.read_text())
    stored["plan"]["micro_batch"], stored["plan"]["accum_steps"] = 1, 64  # a bad plan in the cache
    # ... marked by a wall time no probe of this task takes: on a loaded 2-core machine a fresh probe may
    # itself pick micro 1 (passes at larger sizes run parallel kernels, which stall under oversubscription),
    # so the plan alone cannot tell a fresh entry from the injected one
    stored["wall_time_s"] = SENTINEL_WALL_S
    path.write_text(json.dumps(stored))
    code, out, _ = run(capsys, *TINY, *cache, "--json")
    served = json.loads(out)
    assert served["plan"]["micro_batch"] == 1 and served["wall_time_s"] == SENTINEL_WALL_S  # served from the cache
    code, out, _ = run(capsys, *TINY, *cache, "--refresh", "--json")
    refreshed = json.loads(out)
    assert refreshed["source"] == "probe" and refreshed["wall_time_s"] < SENTINEL_WALL_S
    replaced = json.loads(path.read_text())  # the entry was replaced
    assert replaced["plan"] == refreshed["plan"] and replaced["wall_time_s"] == refreshed["wall_time_s"]


def test_plot_to_a_missing_directory_is_refused_before_probing(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from autoaccum import cli

    monkeypatch.setattr(cli, "probe", lambda *a, **k: pytest.fail("probed before checking --plot"))
    missing = tmp_path / "no" / "such" / "dir" / "probe.png"
    code, out, err = run(capsys, *TINY, "--no-cache", "--plot", str(missing))
    assert code == EXIT_USAGE and out == "" and "Traceback" not in err
    assert f"Invalid --plot '{missing}': its directory '{missing.parent}' does not exist" in err
    assert "Allowed: a file path in an existing directory" in err and f"mkdir -p {missing.parent}" in err


@pytest.mark.parametrize("value", ["-1GiB", "-1e9", "-5"])
def test_a_negative_budget_gets_the_budget_error_not_expected_one_argument(capsys, value):
    with pytest.raises(SystemExit) as info:
        main([*TINY[:-4], "--budget", value])
    _, err = capsys.readouterr()
    assert info.value.code == EXIT_USAGE and "expected one argument" not in err
    assert f"argument --budget: Invalid budget '{value}': must be at least 1 byte. Allowed range: 1 B ~ " in err
    assert "e.g. '8GiB'" in err


def test_plot_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "probe.png"
    code, _, err = run(capsys, *TINY, "--no-cache", "--plot", str(path))
    assert code == EXIT_OK and f"plot written to {path}" in err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _subprocess(args: list[str], cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}  # never the user's ~/.cache
    env["PYTHONPATH"] = str(Path(autoaccum.__file__).resolve().parent.parent)  # installed or not
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_python_m_autoaccum_keeps_stdout_for_json(tmp_path):
    result = _subprocess([sys.executable, "-m", "autoaccum", *TINY, "--json", "-v"], TESTS, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kind"] == "autoaccum.probe"
    assert "probe micro-batch" in result.stderr


def test_console_script_finds_a_task_module_in_the_working_directory(tmp_path):
    script = Path(sys.executable).parent / "autoaccum"
    if not script.exists():
        pytest.skip("the autoaccum console script is not installed next to this python")
    result = _subprocess([str(script), *TINY, "--json"], TESTS, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plan"]["target_batch"] == 64
    assert list(tmp_path.glob("autoaccum/probe-*.json"))  # cached under XDG_CACHE_HOME


@pytest.mark.gpu
def test_probe_on_cuda(tmp_path):
    result = _subprocess([sys.executable, "-m", "autoaccum", "probe", "--device", "cuda", "--budget", "2GiB",
                          "--json", "--no-cache"], TESTS, tmp_path)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["device"].startswith("cuda") and doc["meter"] == "cuda" and not doc["is_estimate"]
    assert doc["plan"]["target_batch"] == 256


def test_a_task_that_declares_lengths_is_probed_by_length_and_planned_by_tokens(capsys):
    code, out, _ = run(capsys, "probe", "--task", "_cli_tasks:variable_length", "--target-batch", "64",
                       "--budget", "12MiB", "--no-cache")
    assert code == EXIT_OK
    lines = out.splitlines()
    assert any(line.split()[:4] == ["length", "micro-batch", "status", "peak"] for line in lines)
    assert any(line.startswith("lengths: 8 to 48, median 8 (all 64 samples)") for line in lines)
    assert any(line.startswith("memory: ") and " for each sample of length L (the optimizer step needs" in line
               for line in lines)
    assert lines[-1].startswith("batch 64 cut by length: up to ") and " micro-batches, by the lengths" in lines[-1]
    code, out, _ = run(capsys, "probe", "--task", "_cli_tasks:variable_length", "--target-batch", "64",
                       "--budget", "12MiB", "--no-cache", "--json")
    doc = json.loads(out)
    assert doc["plan"]["tokens"]["longest"] == 48 and doc["lengths"]["longest"] == 48
    assert {c["length"] for c in doc["candidates"]} == {8, 48} and doc["token_model"]["per_token_bytes"] > 0


def test_a_task_drawing_from_a_dataloaders_data_is_probed_on_it_and_its_json_is_a_plan_for_fit(capsys, tmp_path):
    import _cli_tasks

    drawn = []
    real = _cli_tasks.pairs
    _cli_tasks.pairs = lambda rows: drawn.append(len(rows)) or real(rows)  # the loader's collate_fn, seen by the probe
    try:
        code, out, _ = run(capsys, "probe", "--task", "_cli_tasks:from_loader", "--budget", "400000",
                           "--target-batch", "64", "--no-cache", "--json")
    finally:
        _cli_tasks.pairs = real
    assert code == EXIT_OK
    doc = json.loads(out)
    sizes = sorted(c["micro_batch"] for c in doc["candidates"])
    assert drawn and set(sizes) <= set(drawn) and max(sizes) > len(_cli_tasks.Rows())  # repeated past 40 rows
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(out)
    x, y = _cli_tasks.pairs([_cli_tasks.Rows()[i] for i in range(40)])
    result = autoaccum.fit(_cli_tasks.mlp(), (x.repeat(4, 1), y.repeat(4)), 64, loss_fn=_cli_tasks.mlp_loss,
                           plan=str(plan_file), max_steps=1, progress=False, verbose=False)
    assert result.plan_source == "given" and result.plan.micro_batch == doc["plan"]["micro_batch"]


def test_version_names_autoaccum_and_torch(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"autoaccum {autoaccum.__version__} (torch ") and torch.__version__ in out


def test_no_cache_with_refresh_is_refused_before_any_measurement(capsys, tmp_path):
    code, out, err = run(capsys, *TINY, "--no-cache", "--refresh", "--cache-dir", str(tmp_path))
    assert code == EXIT_USAGE and out == "" and "--refresh" in err and "--no-cache" in err
    assert not any(tmp_path.iterdir())
    code, _, _ = run(capsys, *TINY, "--refresh", "--cache-dir", str(tmp_path))  # control: --refresh alone runs
    assert code == EXIT_OK
