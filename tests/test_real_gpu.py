"""Smoke test of the real-GPU benchmark (benchmarks/real_gpu.py, the package benchmarks/realgpu/), its
issue40 rows (``--rows issue40``: the models people bring, fit against a hand-written loop), and of what
the GPU sessions need besides it: ``compare.py --out`` (resumable by workload), benchmarks/gpu_session.sh.

On a CPU the benchmark runs its small models under an emulated budget, squeeze (iii) only: (i) and (ii)
need CUDA and must be skipped with their reason, never imitated. The tests marked ``gpu`` check the two
CUDA squeezes themselves (they run in ``pytest -m gpu``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
MODELS = ["gpt2", "mlp"]  # a Hugging Face model with a token-level loss, and a tuple batch (seconds, not minutes)
FIT_STEPS = 3


@pytest.fixture(scope="module")
def rg():
    """The benchmark's modules, imported from benchmarks/ (not an installed package)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        names = ("brute", "cli", "loops", "models", "parts", "report", "runner", "squeeze", "table40")
        modules = {name: importlib.import_module(f"realgpu.{name}") for name in names}
        modules["compare"] = SimpleNamespace(runner=importlib.import_module("headtohead.runner"))
        yield SimpleNamespace(**modules)
    for name in [n for n in sys.modules if n.split(".")[0] in ("realgpu", "headtohead", "common")]:
        del sys.modules[name]


def _args(rg, out: Path, *extra: str):
    return rg.cli.parse(["--size", "cpu", "--device", "cpu", "--models", *MODELS, "--fit-steps", str(FIT_STEPS),
                         "--no-search", "--out", str(out), *extra])


@pytest.fixture(scope="module")
def smoke(rg, tmp_path_factory, one_thread):
    pytest.importorskip("transformers")  # GPT-2 from its config; the other tests need no Hugging Face
    out = tmp_path_factory.mktemp("real_gpu")
    said: list[str] = []
    return SimpleNamespace(out=out, doc=rg.cli.run(_args(rg, out), log=said.append), said=said)


def _row(doc: dict, model: str, squeeze: str) -> dict:
    return next(r for r in doc["rows"] if r["model"] == model and r["squeeze"] == squeeze)


def test_cuda_squeezes_are_skipped_with_their_reason_on_a_cpu(rg, smoke):
    for model in MODELS:
        for squeeze in ("process", "fraction"):
            reason = _row(smoke.doc, model, squeeze)["skipped"]
            assert reason.startswith("skipped: needs CUDA") and "squeeze (iii)" in reason
            part = json.loads((smoke.out / f"{model}.json").read_text())["parts"][f"squeeze:{squeeze}"]
            assert part == {"skipped": reason}  # nothing imitated: no probe, no brute force
    assert smoke.doc["cpu_smoke"] and smoke.doc["note"] == rg.cli.CPU_NOTE


def test_the_budget_squeeze_measures_every_column(smoke):
    for model in MODELS:
        r = _row(smoke.doc, model, "budget")
        assert r["probe_budget_source"] == "given" and r["probe_budget_bytes"] == r["true_budget_bytes"]
        assert len(r["brute_force"]) == 2 and r["brute_force"][0] == r["brute_force"][1]  # deterministic on a CPU
        assert r["brute_confirmed"] and not r["brute_capped"]
        assert r["found_vs_brute"] >= 0.95 and r["probe_ooms"] == 0
        assert r["fit"]["steps"] == FIT_STEPS and r["fit"]["ooms"] == 0 and r["fit"]["error"] is None
        assert r["fit_peak_vs_usable"] <= 1.0
        assert r["probe_step_equivalents"] > 0 and r["step_time_s"] > 0
        assert r["pick_vs_sweep"]["pick"] == r["plan"]["micro_batch"] and r["pick_vs_sweep"]["ratio"] > 0
        assert r["pick_vs_sweep"]["best"] <= min(r["brute_force"])  # the sweep's best is judged under the limit
        assert r["estimate"]["allocated"]["median_abs"] < 0.05  # fake tensors count what the counter counts
        assert r["estimate"]["reserved"] is None  # a CPU has no allocator cache


def test_fit_ooms_on_a_plan_that_does_not_fit_are_counted(rg, smoke, one_thread):
    """Negative control: a plan above the limit must show up as OOMs in the fit column, not vanish."""
    report = json.loads((smoke.out / "mlp.json").read_text())["parts"]["squeeze:budget"]["probe"]
    limit = _row(smoke.doc, "mlp", "budget")["brute_force"][0]
    plan = {**report["plan"], "micro_batch": report["plan"]["target_batch"], "accum_steps": 1}
    assert plan["micro_batch"] > limit
    w = rg.models.workloads("cpu")["mlp"]
    built, device = rg.models.build(w), torch.device("cpu")
    with rg.squeeze.squeeze("budget", w.budget_bytes, device) as sq:
        fitted = rg.parts._fit(built, device, sq, {**report, "plan": plan}, rg.parts.Settings.for_size("cpu", 2))
    assert fitted["error"] is None and fitted["steps"] == 2 and fitted["ooms"] >= 1
    assert fitted["final_micro_batch"] <= limit and any("OOM" in m for m in fitted["plan_changes"])


def test_a_rerun_measures_nothing_again(rg, smoke, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a part was measured again")

    for name in ("estimate", "squeezed", "sweep", "search"):
        monkeypatch.setattr(rg.parts, name, fail)
    said: list[str] = []
    again = rg.cli.run(_args(rg, smoke.out), log=said.append)
    assert again["rows"] == smoke.doc["rows"]
    assert [s for s in said if "nothing left to measure" in s] == \
        [f"{m}: nothing left to measure in {smoke.out / f'{m}.json'} (--redo measures again)" for m in MODELS]


def test_a_part_that_fails_is_kept_and_the_row_goes_on(rg, smoke, tmp_path, monkeypatch):
    """Resumable by part: a deleted part is measured again (here it raises), the others are read back."""
    doc = json.loads((smoke.out / "mlp.json").read_text())
    del doc["parts"]["sweep"]
    (tmp_path / "mlp.json").write_text(json.dumps(doc))

    def broken(*args, **kwargs):
        raise RuntimeError("sweep broke")

    monkeypatch.setattr(rg.parts, "sweep", broken)
    monkeypatch.setattr(rg.parts, "squeezed", lambda *a, **k: pytest.fail("a finished squeeze ran again"))
    args = rg.cli.parse(["--size", "cpu", "--device", "cpu", "--models", "mlp", "--fit-steps", str(FIT_STEPS),
                         "--no-search", "--out", str(tmp_path)])
    result = rg.cli.run(args)
    saved = json.loads((tmp_path / "mlp.json").read_text())["parts"]
    assert saved["sweep"]["error"] == "RuntimeError: sweep broke"
    assert saved["search"] == {"skipped": "skipped: --no-search"}
    assert _row(result, "mlp", "budget")["pick_vs_sweep"] is None and _row(result, "mlp", "budget")["found"] > 0


def test_files_made_under_other_settings_are_not_reused(rg, smoke, monkeypatch, tmp_path):
    doc = json.loads((smoke.out / "mlp.json").read_text())
    (tmp_path / "mlp.json").write_text(json.dumps(doc))
    header = {k: doc[k] for k in ("kind", "version", "model", "size", "device_type", "settings")}
    assert rg.runner._load(tmp_path / "mlp.json", header, redo=False) == doc
    assert rg.runner._load(tmp_path / "mlp.json", header, redo=True)["parts"] == {}
    other = {**header, "settings": {**header["settings"], "fit_steps": 50}}
    assert rg.runner._load(tmp_path / "mlp.json", other, redo=False)["parts"] == {}


def test_main_on_a_cpu_prints_the_table_and_json(rg, smoke, tmp_path, capsys):
    assert rg.cli.main(rg.cli.__doc__, ["--size", "cpu", "--device", "cpu", "--models", *MODELS, "--fit-steps",
                                        str(FIT_STEPS), "--no-search", "--out", str(smoke.out)]) == 0
    out = capsys.readouterr().out
    assert "| gpt2  | (i) other process    | skipped: needs CUDA" in out and rg.cli.CPU_NOTE in out
    doc = json.loads(out[out.index("\n{") + 1:])
    assert doc["kind"] == "autoaccum.bench.real_gpu" and len(doc["rows"]) == 3 * len(MODELS)


def test_brute_force_doubles_bisects_and_checks_b_and_b_plus_one(rg):
    def attempt(limit):
        return lambda b: rg.brute.Try(b, b <= limit, b > limit, b, None, 0.0)

    found = rg.brute.brute_force(attempt(11), smallest=1, upper=64, max_tries=40)
    assert [t.micro_batch for t in found.tries] == [1, 2, 4, 8, 16, 12, 10, 11, 11, 12]
    assert (found.limit, found.capped, found.confirmed) == (11, False, True)
    top = rg.brute.brute_force(attempt(100), smallest=2, upper=40, max_tries=40)
    assert [t.micro_batch for t in top.tries] == [2, 4, 8, 16, 32, 40, 40]  # the upper end itself, checked
    assert top.limit == 40 and top.confirmed
    assert rg.brute.brute_force(attempt(0), smallest=2, upper=40, max_tries=40).limit == 0
    capped = rg.brute.brute_force(attempt(11), smallest=1, upper=64, max_tries=6)
    assert (capped.limit, capped.capped, len(capped.tries)) == (8, True, 6)
    # negative control: a size that fits once and not the next time is reported, not hidden
    flaky = iter([True, True, True, True, False, True, True, False, False])
    odd = rg.brute.brute_force(lambda b: rg.brute.Try(b, next(flaky), False, b, None, 0.0), 1, 64, 40)
    assert odd.tries[-1].micro_batch == 14 and odd.limit == 14 and not odd.confirmed


def test_sweep_sizes_are_the_balanced_plans_under_the_largest_limit(rg):
    assert rg.parts.sweep_sizes(32, 1, 12, 4, 16) == ([11, 8, 7, 6, 5, 4, 3], False)
    assert rg.parts.sweep_sizes(256, 2, 100, 4, 3) == ([86, 64, 52], True)


def test_estimate_errors_are_against_every_try_that_ran(rg):
    estimate = {"report": {"model": {"base_bytes": 100.0, "per_sample_bytes": 10.0, "opt_peak_bytes": 0,
                                     "residual": 0.0, "num_points": 3}}}
    tries = [{"micro_batch": 10, "oom": False, "peak_bytes": 200, "reserved_peak_bytes": 250},
             {"micro_batch": 20, "oom": False, "peak_bytes": 300, "reserved_peak_bytes": 400},
             {"micro_batch": 40, "oom": True, "peak_bytes": 999, "reserved_peak_bytes": 999}]  # left out
    errors = rg.report._estimate_errors(estimate, [{"tries": tries}])
    assert errors["points"] == 2
    assert errors["allocated"] == {"median_abs": 0.0, "worst_abs": 0.0, "median": 0.0}
    assert errors["reserved"]["worst_abs"] == pytest.approx(0.25) and errors["reserved"]["median"] < 0


def test_a_cuda_squeeze_refuses_to_run_on_a_cpu(rg):
    assert rg.squeeze.skip_reason("budget", torch.device("cpu")) is None
    with pytest.raises(ValueError, match="needs CUDA"):
        with rg.squeeze.squeeze("fraction", 2**30, torch.device("cpu")):
            pass


def test_compare_is_resumable_by_workload(rg, tmp_path, monkeypatch):
    """Each workload's result is saved as it finishes and read back by the next run with the same settings
    (the workloads themselves are smoke-tested in tests/test_compare.py)."""
    runner = rg.compare.runner
    ran: list[str] = []

    def run_workload(name, w, config, log):
        ran.append(name)
        return {"model": name, "steps": config.steps, "path": tmp_path}  # a Path: saved as text, as printed

    monkeypatch.setattr(runner, "run_workload", run_workload)
    config = runner.Config(size="tiny", models=("mlp", "gpt"), systems=("hand",), steps=4, out=str(tmp_path))
    first = runner.run(config)
    assert ran == ["mlp", "gpt"] and first["results"][0] == {"model": "mlp", "steps": 4, "path": str(tmp_path)}
    said: list[str] = []
    assert runner.run(config, said.append)["results"] == first["results"] and ran == ["mlp", "gpt"]
    assert said == [f"{m}: results read from {tmp_path / f'{m}.json'} (--redo runs it again)" for m in ("mlp", "gpt")]
    (tmp_path / "gpt.json").unlink()  # a run that stopped before this workload: only it runs
    runner.run(config)
    assert ran == ["mlp", "gpt", "gpt"]
    runner.run(runner.Config(**{**vars(config), "steps": 5}))  # other settings: everything again
    runner.run(runner.Config(**{**vars(config), "redo": True}))
    assert ran == ["mlp", "gpt", "gpt", "mlp", "gpt", "mlp", "gpt"]
    assert runner.run(runner.Config(**{**vars(config), "out": None}))["results"][0]["steps"] == 4  # nothing saved


@pytest.mark.gpu
def test_another_process_leaves_this_one_the_budget(rg):
    device = torch.device("cuda:0")
    with rg.squeeze.squeeze("process", 2 * 2**30, device) as sq:
        free, reserved = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
        assert abs(sq.true_budget_bytes - 2 * 2**30) < 64 * 2**20
        assert abs(free + reserved - sq.true_budget_bytes) < 64 * 2**20
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(3 * 2**30, dtype=torch.uint8, device=device)
    assert torch.cuda.mem_get_info(device)[0] > 4 * 2**30  # the other process is gone


@pytest.mark.gpu
def test_the_fraction_caps_this_process(rg):
    device = torch.device("cuda:0")
    with rg.squeeze.squeeze("fraction", 2**30, device) as sq:
        assert sq.probe_budget is None and abs(sq.true_budget_bytes - 2**30) < 2**20
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2**30 + 2**28, dtype=torch.uint8, device=device)
    x = torch.empty(2**30 + 2**28, dtype=torch.uint8, device=device)  # the cap is lifted afterwards
    del x


ROWS40 = ["gpt2_355m_bf16", "llama_1b_lora_bf16"]  # bf16 autocast, a token-level loss, a LoRA adapter (peft)


@pytest.fixture(scope="module")
def smoke40(rg, tmp_path_factory, one_thread):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("real_gpu40")
    models = ROWS40 if importlib.util.find_spec("peft") is not None else ROWS40[:1]
    args = rg.cli.parse(["--rows", "issue40", "--size", "cpu", "--device", "cpu", "--models", *models,
                         "--out", str(out)])
    return SimpleNamespace(out=out, models=models, doc=rg.cli.run(args))


@pytest.mark.slow  # every part of four rows, brute force included
def test_issue40_rows_measure_every_column_on_a_cpu(rg, smoke40):
    assert smoke40.doc["settings"]["squeezes"] == ["budget"] and smoke40.doc["cpu_smoke"]
    for r in smoke40.doc["rows"]:
        doc = json.loads((smoke40.out / f"{r['model']}.json").read_text())
        assert list(doc["parts"]) == ["squeeze:budget", "estimate", "sweep"]  # in that order
        assert r["squeeze"] == "budget" and r["found_vs_brute"] == 1.0 and r["probe_ooms"] == 0
        assert r["brute_confirmed"] and not r["brute_capped"]
        assert r["plan"]["accum_steps"] > 1  # squeezed: the target needs accumulation
        assert r["brute_tries"][:2] == [r["found"], r["found"] + 1]  # the search starts at the probe's answer
        assert r["fit"]["ooms"] == 0 and r["fit"]["error"] is None and r["fit"]["steps"] == doc["parts"][
            "squeeze:budget"]["compare"]["steps"]
        assert r["fit_vs_hand"]["ratio"] > 0 and r["fit_vs_hand"]["hand_samples_per_s"] > 0
        assert r["estimate"]["allocated"]["median_abs"] < 0.05 and r["estimate"]["points"] >= 2
        assert doc["parts"]["squeeze:budget"]["probe"]["precision"] == "bf16"
    assert "| gpt2_355m_bf16" in rg.table40.table(smoke40.doc["rows"])
    assert any("fit's samples/s >= 0.99" in t for t in smoke40.doc["targets"])


@pytest.mark.slow  # shares the rows above
def test_issue40_rows_resume_from_their_files(rg, smoke40, monkeypatch):
    for name in ("estimate", "squeezed", "sweep"):
        monkeypatch.setattr(rg.parts, name, lambda *a, **k: pytest.fail("a part was measured again"))
    args = rg.cli.parse(["--rows", "issue40", "--size", "cpu", "--device", "cpu", "--models", *smoke40.models,
                         "--out", str(smoke40.out)])
    assert rg.cli.run(args)["rows"] == smoke40.doc["rows"]


def test_brute_force_around_a_start_tries_b_and_b_plus_one_first(rg):
    def attempt(limit):
        return lambda b: rg.brute.Try(b, b <= limit, b > limit, b, None, 0.0)

    def tried(start, limit, smallest=1, upper=64, max_tries=20):
        found = rg.brute.brute_around(attempt(limit), start, smallest, upper, max_tries)
        return [t.micro_batch for t in found.tries], found.limit, found.confirmed, found.capped

    assert tried(11, 11) == ([11, 12], 11, True, False)  # a right start: two tries
    assert tried(8, 11) == ([8, 9, 11, 15, 13, 12], 11, True, False)
    assert tried(20, 11) == ([20, 19, 17, 13, 5, 9, 11, 12], 11, True, False)
    assert tried(64, 64) == ([64], 64, True, False)  # the upper end: nothing above to try
    assert tried(11, 0) == ([11, 10, 8, 4, 1], 0, True, False)
    assert tried(3, 40, max_tries=3) == ([3, 4, 6], 6, True, True)  # capped: the largest size seen to fit


def test_the_loops_rate_leaves_out_the_first_steps(rg):
    assert rg.loops.rate([0.0, 5.0, 10.0, 11.0, 13.0], 8) == pytest.approx(8 * 2 / 3.0)
    assert rg.loops.rate([0.0, 5.0, 10.0], 8) is None  # one step after the two left out: no interval


def test_gpu_session_dry_run_lists_the_steps_in_priority_order(tmp_path):
    result = subprocess.run(["bash", str(BENCHMARKS / "gpu_session.sh"), "--dry-run"], capture_output=True,
                            text=True, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "o")},
                            timeout=60)
    assert result.returncode == 0, result.stderr
    steps = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["env", "pytest_gpu", "ddp_gpu", "row_gpt2_355m_bf16", "row_llama_1b_lora_bf16", "row_vit_b16_bf16",
                     "row_resnet50_bf16", "row_vit_b16_fp32", "row_resnet50_fp32", "report"]
    assert "--rows issue40" in result.stdout and "--size gpu" in result.stdout


def test_report_only_reads_gpu_files_on_a_machine_without_cuda(rg, tmp_path, capsys):
    """The table of a GPU session is printed wherever its files are (here: none yet, every row says so)."""
    assert rg.cli.main(rg.cli.__doc__, ["--rows", "issue40", "--size", "gpu", "--device", "cuda:0", "--report-only",
                                        "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| gpt2_355m_bf16     | not measured yet" in out and "Targets (issue 40):" in out
