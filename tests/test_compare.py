"""Smoke test of benchmarks/compare.py (issue 7): the autoaccum and hand-written parts, tiny, in-process.

Skipped where the peers (the ``bench`` extra: accelerate, lightning, transformers) are not installed:
the benchmark exists to compare against them, and CI without them must still pass.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

COMPARE = Path(__file__).resolve().parent.parent / "benchmarks" / "compare.py"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("compare_bench", COMPARE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare_bench"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("compare_bench", None)


@pytest.fixture(scope="module")
def doc(compare):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = compare.Config(size="tiny", models=("mlp",), systems=("autoaccum", "hand"), steps=4, isolate=False)
        return compare.run(config)
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
    assert after["error"] is None and "replayed in place" in after["outcome"]
    assert after["micro_batch_after"] <= result["runtime_drop"]["fits_micro"]
    assert after["recovery_s"] is not None
    assert (after["repeated_samples"], after["lost_samples"]) == (0, 0)
    assert after["max_rel_diff"] < 1e-10  # the OOM changed nothing but speed


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
    w = compare.workloads("tiny")["mlp"]
    assert result["truly_fits"] == w.micro_target  # the budget is set between micro_target and +1


def test_the_peers_recognise_the_benchmark_oom_but_not_the_raw_one(compare):
    from accelerate.utils.memory import should_reduce_batch_size
    from lightning.pytorch.utilities.memory import is_oom_error

    model = torch.nn.Linear(8, 8)
    errors = {}
    for name, budget in (("raw", compare.TrackedMemory(budget_bytes=64)),
                         ("peer", compare.PeerVisibleBudget(64))):
        with pytest.raises(torch.OutOfMemoryError) as caught, budget.track(model):
            model(torch.ones(4, 8))
        errors[name] = caught.value
    assert should_reduce_batch_size(errors["peer"]) and is_oom_error(errors["peer"])
    # negative control: autoaccum's own message is not what the peers look for
    assert not should_reduce_batch_size(errors["raw"]) and not is_oom_error(errors["raw"])


def test_results_section_replaces_only_its_own(compare, doc, tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## Probe (issue 2)\n\nkeep me\n\n"
                    f"{compare.SECTION}\n\nold table\n\n## Later section\n\nkeep me too\n")
    compare.write_section(doc, "python benchmarks/compare.py --size tiny", path)
    text = path.read_text()
    assert "keep me\n" in text and "keep me too" in text and "old table" not in text
    assert text.count(compare.SECTION) == 1
    assert "| mlp | autoaccum |" in text and "torch " + torch.__version__ in text

    # a GPU run's table goes beside the CPU one; rewriting the CPU one keeps it
    gpu = {**doc, "config": {**doc["config"], "device": "cuda"}, "machine": "Linux, 16 cores, NVIDIA H100"}
    compare.write_section(gpu, "python benchmarks/compare.py --device cuda --size gpu", path)
    compare.write_section(doc, "python benchmarks/compare.py --size tiny", path)
    text = path.read_text()
    assert "### CPU, emulated budget" in text and "### NVIDIA H100 (cuda)" in text
    assert text.index("### CPU") < text.index("### NVIDIA") < text.index("## Later section")
    assert text.count(compare.SECTION) == 1 and text.count("### CPU, emulated budget") == 1
