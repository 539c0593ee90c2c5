"""Smoke test of the head-to-head benchmark (issue 7; benchmarks/compare.py, the package
benchmarks/headtohead/): the autoaccum and hand-written parts, tiny, in-process.

Skipped where the peers (the ``bench`` extra: accelerate, lightning, transformers) are not installed:
the benchmark exists to compare against them, and CI without them must still pass.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from autoaccum import TrackedMemory

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def compare():
    """The benchmark's modules, imported from benchmarks/ (not an installed package)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        names = ("workloads", "budget", "runner", "report")
        modules = {name: importlib.import_module(f"headtohead.{name}") for name in names}
        yield SimpleNamespace(**modules)
    for name in [n for n in sys.modules if n == "headtohead" or n.startswith("headtohead.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def doc(compare):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = compare.runner.Config(size="tiny", models=("mlp",), systems=("autoaccum", "hand"), steps=4,
                                       isolate=False)
        return compare.runner.run(config)
    finally:
        torch.set_num_threads(threads)


def test_autoaccum_trains_the_exact_global_batch_and_survives_the_budget_drop(doc):
    result = doc["results"][0]
    row = result["systems"]["autoaccum"]
    assert row["error"] is None
    assert row["global_batches"] == [result["target_batch"]]  # every step saw exactly the target
    assert row["optimizer_steps"] == 4
    assert (row["repeated_samples"], row["lost_samples"], row["inconsistent_steps"]) == (0, 0, 0)
    assert 1 <= row["micro_batch"] < result["target_batch"]
    assert row["find_steps"] >= 2 and row["find_time_s"] > 0
    assert row["max_rel_diff"] < 1e-10  # fp64: accumulated = full batch

    after = row["runtime_oom"]
    assert after["error"] is None
    if after["outcome"].startswith("no OOM"):
        # The probe's speed choice (noisy on a loaded machine) may pick a size the lower budget
        # still holds: then no OOM is the right outcome, and only then.
        assert row["micro_batch"] <= result["runtime_drop"]["fits_micro"], after["outcome"]
    else:
        assert "replayed in place" in after["outcome"], after["outcome"]
    assert after["micro_batch_after"] <= result["runtime_drop"]["fits_micro"]
    assert after["recovery_s"] is not None
    assert (after["repeated_samples"], after["lost_samples"]) == (0, 0)
    assert after["max_rel_diff"] < 1e-10  # the OOM changed nothing but speed


@pytest.fixture(scope="module")
def integrations_doc(compare):
    """autoaccum inside the Trainer, Lightning and Accelerate (issue 13), tiny, in-process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = compare.runner.Config(size="tiny", models=("mlp",), steps=4, isolate=False,
                                       systems=("autoaccum_trainer", "autoaccum_lightning", "autoaccum_accelerate"))
        return compare.runner.run(config)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("system", ["autoaccum_trainer", "autoaccum_lightning", "autoaccum_accelerate"])
def test_autoaccum_inside_each_framework_is_exact_and_replays_the_budget_drop_in_place(integrations_doc, system):
    result = integrations_doc["results"][0]
    row = result["systems"][system]
    assert row["error"] is None and row["optimizer_steps"] == 4
    assert row["global_batches"] == [result["target_batch"]]
    assert (row["repeated_samples"], row["lost_samples"], row["inconsistent_steps"]) == (0, 0, 0)
    assert 1 <= row["micro_batch"] < result["target_batch"] and row["find_steps"] >= 2  # the probe, counted as find
    assert row["max_rel_diff"] < 1e-10
    after = row["runtime_oom"]
    assert after["error"] is None and "replayed in place" in after["outcome"] and after["attempts"] == 1
    assert (after["repeated_samples"], after["lost_samples"]) == (0, 0) and after["max_rel_diff"] < 1e-10


def test_hand_loop_is_exact_until_the_budget_drops_then_stops(doc):
    result = doc["results"][0]
    row = result["systems"]["hand"]
    assert row["find_steps"] == 0 and row["error"] is None
    assert row["global_batches"] == [result["target_batch"]]
    assert row["micro_batch"] <= result["truly_fits"] and result["target_batch"] % row["micro_batch"] == 0
    assert row["max_rel_diff"] < 1e-10  # equal micro-batches of a mean loss: exact
    assert row["runtime_oom"]["error"].startswith("crashed: OutOfMemoryError")


def test_brute_force_finds_the_budgeted_micro_batch(doc, compare):
    result = doc["results"][0]
    w = compare.workloads.workloads("tiny")["mlp"]
    assert result["truly_fits"] == w.micro_target  # the budget is set between micro_target and +1


def test_the_peers_recognise_the_emulated_oom_and_the_budget_records_it(compare):
    from accelerate.utils.memory import should_reduce_batch_size
    from lightning.pytorch.utilities.memory import is_oom_error

    model = torch.nn.Linear(8, 8)
    errors = {}
    for name, budget in (("raw", TrackedMemory(budget_bytes=64)), ("bench", compare.budget.EmulatedBudget(64))):
        with pytest.raises(torch.OutOfMemoryError) as caught, budget.track(model):
            model(torch.ones(4, 8))
        errors[name] = caught.value
    assert str(errors["raw"]) == str(errors["bench"])  # the benchmark's budget changes nothing in the error
    for error in errors.values():
        assert should_reduce_batch_size(error) and is_oom_error(error)
    assert budget.ooms == 1 and len(budget.oom_times) == 1
    # negative control: the peers do react to text, so an autoaccum message without it would go unseen
    plain = torch.OutOfMemoryError("Emulated out of memory in aten.ones: tried to allocate 128 B")
    assert not should_reduce_batch_size(plain) and not is_oom_error(plain)


def test_results_section_replaces_only_its_own(compare, doc, tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## Probe (issue 2)\n\nkeep me\n\n"
                    f"{compare.report.SECTION}\n\nold table\n\n## Later section\n\nkeep me too\n")
    compare.report.write_section(doc, "python benchmarks/compare.py --size tiny", path)
    text = path.read_text()
    assert "keep me\n" in text and "keep me too" in text and "old table" not in text
    assert text.count(compare.report.SECTION) == 1
    assert "| mlp | autoaccum |" in text and "torch " + torch.__version__ in text

    # a GPU run's table goes beside the CPU one; rewriting the CPU one keeps it
    gpu = {**doc, "config": {**doc["config"], "device": "cuda"}, "machine": "Linux, 16 cores, NVIDIA H100"}
    compare.report.write_section(gpu, "python benchmarks/compare.py --device cuda --size gpu", path)
    compare.report.write_section(doc, "python benchmarks/compare.py --size tiny", path)
    text = path.read_text()
    assert "### CPU, emulated budget" in text and "### NVIDIA H100 (cuda)" in text
    assert text.index("### CPU") < text.index("### NVIDIA") < text.index("## Later section")
    assert text.count(compare.report.SECTION) == 1 and text.count("### CPU, emulated budget") == 1


def test_results_section_keeps_the_method_prose(compare, doc, tmp_path):
    """The method is written up in RESULTS.md only: rewriting the section must keep it, first, as it is."""
    path = tmp_path / "RESULTS.md"
    path.write_text(compare.report.RESULTS.read_text())
    method = compare.report.METHOD
    before = path.read_text()
    kept = before[before.index(method):before.index("\n### ", before.index(method) + 1)]
    assert "EmulatedBudget" in kept  # the real prose, not an empty heading

    compare.report.write_section(doc, "python benchmarks/compare.py --size tiny", path)
    compare.report.write_section(doc, "python benchmarks/compare.py --size tiny", path)
    text = path.read_text()
    assert text.count(method) == 1 and kept in text
    section = text[text.index(compare.report.SECTION):]
    assert section.index(compare.report.COLUMNS) < section.index(method) < section.index("### CPU, emulated budget")
    # everything outside the section is as it was
    start, end = before.index(compare.report.SECTION), text.index(compare.report.SECTION)
    assert text[:end] == before[:start]
    assert text[text.index("\n## ", end + 1):] == before[before.index("\n## ", start + 1):]
