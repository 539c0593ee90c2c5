"""Smoke test of the real-GPU benchmark (benchmarks/real_gpu.py, the package benchmarks/realgpu/: the
models people bring, the probe against brute force, fit against the hand-written loop) and of what the
GPU sessions need besides it: ``compare.py --out`` (resumable by workload), benchmarks/gpu_session.sh.

On a CPU the benchmark runs its rows at small sizes under an emulated budget: the other-process squeeze
needs CUDA. The test marked ``gpu`` checks that squeeze itself (it runs in ``pytest -m gpu``).
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
#: bf16 autocast and a token-level loss (seconds, not minutes); with peft, a LoRA adapter too
MODELS = ["gpt2_355m_bf16", "llama_1b_lora_bf16"] if importlib.util.find_spec("peft") else ["gpt2_355m_bf16"]


@pytest.fixture(scope="module")
def rg():
    """The benchmark's modules, imported from benchmarks/ (not an installed package)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        names = ("brute", "cli", "loops", "models", "parts", "runner", "squeeze", "table")
        modules = {name: importlib.import_module(f"realgpu.{name}") for name in names}
        modules["compare"] = SimpleNamespace(runner=importlib.import_module("headtohead.runner"))
        yield SimpleNamespace(**modules)
    for name in [n for n in sys.modules if n.split(".")[0] in ("realgpu", "headtohead", "common")]:
        del sys.modules[name]


def _args(rg, out: Path, *extra: str):
    return rg.cli.parse(["--size", "cpu", "--device", "cpu", "--models", *MODELS, "--out", str(out), *extra])


@pytest.fixture(scope="module")
def smoke(rg, tmp_path_factory, one_thread):
    pytest.importorskip("transformers")  # the rows are Hugging Face models built from their configs
    out = tmp_path_factory.mktemp("real_gpu")
    said: list[str] = []
    return SimpleNamespace(out=out, doc=rg.cli.run(_args(rg, out), log=said.append), said=said)


def test_the_rows_measure_every_column_on_a_cpu(rg, smoke):
    assert smoke.doc["cpu_smoke"] and smoke.doc["note"] == rg.cli.CPU_NOTE
    assert [r["model"] for r in smoke.doc["rows"]] == MODELS
    for r in smoke.doc["rows"]:
        doc = json.loads((smoke.out / f"{r['model']}.json").read_text())
        assert list(doc["parts"]) == ["squeeze", "estimate", "sweep"]  # in that order
        assert r["squeeze"] == "budget" and r["found_vs_brute"] == 1.0 and r["probe_ooms"] == 0
        assert not r["brute_capped"]
        assert r["plan"]["accum_steps"] > 1  # squeezed: the target needs accumulation
        assert r["brute_tries"][:2] == [r["found"], r["found"] + 1]  # the search starts at the probe's answer
        assert r["fit"]["ooms"] == 0 and r["fit"]["error"] is None
        assert r["fit"]["steps"] == doc["parts"]["squeeze"]["compare"]["steps"]
        assert r["fit_vs_hand"]["ratio"] > 0 and r["fit_vs_hand"]["hand_samples_per_s"] > 0
        assert r["pick_vs_sweep"]["pick"] == r["plan"]["micro_batch"] and r["pick_vs_sweep"]["ratio"] > 0
        assert r["pick_vs_sweep"]["best"] <= r["brute_force"]  # the sweep's best is judged under the limit
        assert r["estimate"]["allocated"]["median_abs"] < 0.05 and r["estimate"]["points"] >= 2
        assert r["estimate"]["reserved"] is None  # a CPU has no allocator cache
        assert doc["parts"]["squeeze"]["probe"]["precision"] == "bf16"
    assert "| gpt2_355m_bf16" in rg.table.table(smoke.doc["rows"])
    assert any("fit's samples/s >= 0.99" in t for t in smoke.doc["targets"])


def test_fit_ooms_on_a_plan_that_does_not_fit_are_counted(rg, smoke, one_thread):
    """Negative control: a plan above the limit must show up as OOMs in the fit column, not vanish."""
    part = json.loads((smoke.out / "gpt2_355m_bf16.json").read_text())["parts"]["squeeze"]
    report, limit = part["probe"], part["brute_force"]["limit"]
    plan = {**report["plan"], "micro_batch": report["plan"]["target_batch"], "accum_steps": 1}
    assert plan["micro_batch"] > limit
    w = rg.models.rows("cpu")["gpt2_355m_bf16"]
    fitted = rg.loops._timed_fit(rg.models.build(w, torch.device("cpu")), torch.device("cpu"),
                                 {**report, "plan": plan}, 3, w.budget_bytes, 0.1)
    assert fitted["error"] is None and fitted["steps"] == 3 and fitted["ooms"] >= 1
    assert fitted["starts"] == []  # a replayed step has no step start to time: no rate


def test_a_rerun_measures_nothing_again(rg, smoke, monkeypatch):
    for name in ("estimate", "squeezed", "sweep"):
        monkeypatch.setattr(rg.parts, name, lambda *a, **k: pytest.fail("a part was measured again"))
    said: list[str] = []
    again = rg.cli.run(_args(rg, smoke.out), log=said.append)
    assert again["rows"] == smoke.doc["rows"]
    assert [s for s in said if "nothing left to measure" in s] == \
        [f"{m}: nothing left to measure in {smoke.out / f'{m}.json'} (--redo measures again)" for m in MODELS]


def test_a_part_that_fails_is_kept_and_the_row_goes_on(rg, smoke, tmp_path, monkeypatch):
    """Resumable by part: a deleted part is measured again (here it raises), the others are read back."""
    doc = json.loads((smoke.out / "gpt2_355m_bf16.json").read_text())
    del doc["parts"]["sweep"]
    (tmp_path / "gpt2_355m_bf16.json").write_text(json.dumps(doc))

    def broken(*args, **kwargs):
        raise RuntimeError("sweep broke")

    monkeypatch.setattr(rg.parts, "sweep", broken)
    monkeypatch.setattr(rg.parts, "squeezed", lambda *a, **k: pytest.fail("a finished squeeze ran again"))
    args = rg.cli.parse(["--size", "cpu", "--device", "cpu", "--models", "gpt2_355m_bf16", "--out", str(tmp_path)])
    result = rg.cli.run(args)
    saved = json.loads((tmp_path / "gpt2_355m_bf16.json").read_text())["parts"]
    assert saved["sweep"]["error"] == "RuntimeError: sweep broke"
    assert result["rows"][0]["pick_vs_sweep"] is None and result["rows"][0]["found"] > 0


def test_files_made_under_other_settings_are_not_reused(rg, smoke, tmp_path):
    doc = json.loads((smoke.out / "gpt2_355m_bf16.json").read_text())
    (tmp_path / "gpt2_355m_bf16.json").write_text(json.dumps(doc))
    header = {k: doc[k] for k in ("kind", "version", "model", "size", "device_type", "settings")}
    assert rg.runner._load(tmp_path / "gpt2_355m_bf16.json", header, redo=False) == doc
    assert rg.runner._load(tmp_path / "gpt2_355m_bf16.json", header, redo=True)["parts"] == {}
    other = {**header, "settings": {**header["settings"], "compare_rounds": 3}}
    assert rg.runner._load(tmp_path / "gpt2_355m_bf16.json", other, redo=False)["parts"] == {}


def test_main_on_a_cpu_prints_the_table_and_json(rg, smoke, capsys):
    assert rg.cli.main(rg.cli.__doc__, ["--size", "cpu", "--device", "cpu", "--models", *MODELS,
                                        "--out", str(smoke.out)]) == 0
    out = capsys.readouterr().out
    assert "| gpt2_355m_bf16 " in out and rg.cli.CPU_NOTE in out
    doc = json.loads(out[out.index("\n{") + 1:])
    assert doc["kind"] == "autoaccum.bench.real_gpu" and len(doc["rows"]) == len(MODELS)


def test_sweep_sizes_are_the_balanced_plans_under_the_largest_limit(rg):
    assert rg.parts.sweep_sizes(32, 1, 12, 4, 16) == ([11, 8, 7, 6, 5, 4, 3], False)
    assert rg.parts.sweep_sizes(256, 2, 100, 4, 3) == ([86, 64, 52], True)


def test_estimate_errors_are_against_every_try_that_ran(rg):
    estimate = {"report": {"model": {"base_bytes": 100.0, "per_sample_bytes": 10.0, "opt_peak_bytes": 0,
                                     "residual": 0.0, "num_points": 3}}}
    tries = [{"micro_batch": 10, "oom": False, "peak_bytes": 200, "reserved_peak_bytes": 250},
             {"micro_batch": 20, "oom": False, "peak_bytes": 300, "reserved_peak_bytes": 400},
             {"micro_batch": 40, "oom": True, "peak_bytes": 999, "reserved_peak_bytes": 999}]  # left out
    errors = rg.table._estimate_errors(estimate, tries)
    assert errors["points"] == 2
    assert errors["allocated"] == {"median_abs": 0.0, "worst_abs": 0.0, "median": 0.0}
    assert errors["reserved"]["worst_abs"] == pytest.approx(0.25) and errors["reserved"]["median"] < 0


def test_the_other_process_squeeze_refuses_to_run_on_a_cpu(rg):
    with pytest.raises(ValueError, match="needs CUDA"):
        with rg.squeeze.squeeze("process", 2**30, torch.device("cpu")):
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


def test_brute_force_around_a_start_tries_b_and_b_plus_one_first(rg):
    def attempt(limit):
        return lambda b: rg.brute.Try(b, b <= limit, b > limit, b, None, 0.0)

    def tried(start, limit, smallest=1, upper=64, max_tries=20):
        found = rg.brute.brute_around(attempt(limit), start, smallest, upper, max_tries)
        return [t.micro_batch for t in found.tries], found.limit, found.capped

    assert tried(11, 11) == ([11, 12], 11, False)  # a right start: two tries
    assert tried(8, 11) == ([8, 9, 11, 15, 13, 12], 11, False)
    assert tried(20, 11) == ([20, 19, 17, 13, 5, 9, 11, 12], 11, False)
    assert tried(64, 64) == ([64], 64, False)  # the upper end: nothing above to try
    assert tried(11, 0) == ([11, 10, 8, 4, 1], 0, False)
    assert tried(3, 40, max_tries=3) == ([3, 4, 6], 6, True)  # capped: the largest size seen to fit


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
    assert "benchmarks/real_gpu.py --size gpu --device cuda:0 --models gpt2_355m_bf16" in result.stdout


def test_report_only_reads_gpu_files_on_a_machine_without_cuda(rg, tmp_path, capsys):
    """The table of a GPU session is printed wherever its files are (here: none yet, every row says so)."""
    assert rg.cli.main(rg.cli.__doc__, ["--size", "gpu", "--device", "cuda:0", "--report-only",
                                        "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| gpt2_355m_bf16     | not measured yet" in out and "Targets:" in out
