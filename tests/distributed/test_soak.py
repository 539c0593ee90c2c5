"""The fault-injection soak (tests/stress/soak.py), briefly: one episode on 2 gloo ranks of a
few dozen fp64 steps, launched as torchrun would, with OOMs in forward, loss, backward and evaluation
(several ranks at once too), budget drops and rises, a SIGKILL of one rank and an exception on one
rank, each followed by a restart with ``resume="auto"``.

What must hold: no hang, no abort, every rank of a failed incarnation ends on its own, every step's
samples exactly the documented ones (nothing lost, repeated or misattributed) and the final parameters
equal to a fault-free run (<= 1e-10 relative). Negative control: the same episode with a guard that
leaks one failed attempt's gradients into the replay (``--sabotage``) must be caught by the audit and
by the parameter comparison. The audit itself is also checked on hand-made records.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import needs_gloo

SOAK = Path(__file__).resolve().parents[1] / "stress" / "soak.py"
WORLD = 2

pytestmark = [needs_gloo,
              pytest.mark.slow]  # several processes each


@pytest.fixture(scope="module")
def soak() -> Any:
    """tests/stress/soak.py as a module (tests/stress/ is not a package)."""
    spec = importlib.util.spec_from_file_location("autoaccum_soak_bench", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def config(soak: Any) -> Any:
    # rates far above the full soak's, so that a few dozen steps meet every kind of fault; small global
    # batches (64 of 256 samples, 2 ranks: shares of 32), so that steps stay cheap at small micro-batches
    return soak.Config(worlds=(WORLD,), episodes=1, steps=24, samples=256, target_batch=64, eval_samples=128,
                       checkpoint_every=4, eval_every=8, p_oom=0.3, p_multi=0.2, p_eval_oom=0.2, p_drop=0.25,
                       timeout_s=600.0, stall_s=180.0)


@pytest.fixture(scope="module")
def reference(soak: Any, config: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    work = tmp_path_factory.mktemp("soak") / "reference"
    run = soak.run_episode(config, WORLD, -1, work, faults=False)
    assert run["incarnations"][-1].codes == [0] * WORLD, run["incarnations"][-1].stderr_tails
    return {WORLD: torch.load(work / "final0.pt", weights_only=True)}


def _row(soak: Any, config: Any, reference: dict[int, Any], work: Path, **kwargs: Any) -> dict[str, Any]:
    episode = soak.run_episode(config, WORLD, 0, work, **kwargs)
    return soak.summarize(config, [episode], [work], reference)[WORLD] | {"runs": episode["incarnations"]}


@pytest.mark.slow  # two ranks restarted three times, and a fault-free reference
def test_a_short_soak_survives_every_fault_exactly(soak: Any, config: Any, reference: dict[int, Any],
                                                    tmp_path: Path) -> None:
    row = _row(soak, config, reference, tmp_path / "episode")
    tails = [t for run in row.pop("runs") for t in run.stderr_tails]
    # every kind of fault fired, some OOMs on both ranks in one step, and drops that really bit
    kinds = ("oom_forward", "oom_loss", "oom_backward", "oom_eval", "budget_drop", "budget_rise", "multi_rank_steps")
    for kind in kinds + ("emulated_ooms",):
        assert row[kind] > 0, (kind, row)
    assert row["kill"] == 1 and row["error"] == 1 and row["incarnations"] == 3, row
    assert (row["hangs"], row["aborts"], row["not_ended_alone"], row["unexpected_failures"]) == (0, 0, 0, 0), \
        (row, tails)
    assert row["steps_audited"] == config.steps and row["missing_steps"] == 0
    assert (row["lost"], row["repeated"], row["wrong_share"], row["inconsistent"]) == (0, 0, 0, 0), row
    assert row["params_missing"] == 0 and row["params_max_rel_diff"] <= soak.TOLERANCE, row


@pytest.mark.slow
def test_the_soak_catches_a_guard_that_leaks_a_failed_attempt(soak: Any, config: Any, reference: dict[int, Any],
                                                              tmp_path: Path) -> None:
    """Negative control: once per rank, the gradients of an attempt an injected OOM ended are kept into
    the replay (one incarnation: no kill or exception; no budget drop either, as the leaked gradients
    take room a drop's floor does not leave for them)."""
    calm = replace(config, kill=False, error=False, p_drop=0.0)
    row = _row(soak, calm, reference, tmp_path / "sabotaged", sabotage=True)
    tails = [t for run in row.pop("runs") for t in run.stderr_tails]
    assert row["sabotage"] > 0 and row["unexpected_failures"] == 0, (row, tails)
    assert row["repeated"] > 0 and row["inconsistent"] > 0, row
    assert row["params_max_rel_diff"] > 1e3 * soak.TOLERANCE, row


def test_the_audit_counts_a_lost_a_repeated_and_a_misplaced_sample(soak: Any, config: Any) -> None:
    expected = soak.expected_batches(config, WORLD)
    events = [{"type": "step", "step": step, "rank": rank, "incarnation": 0, "ids": list(ids)}
              for step, shares in enumerate(expected, start=1) for rank, ids in enumerate(shares)]
    assert soak.audit(events, expected, WORLD) == {"steps_audited": config.steps, "lost": 0, "repeated": 0,
                                                   "wrong_share": 0, "missing_steps": 0, "inconsistent": 0}
    # a restart replays step 3 with one sample lost: the record of the later incarnation counts
    replay = {**events[4], "incarnation": 1, "ids": events[4]["ids"][1:]}
    assert soak.audit(events + [replay], expected, WORLD)["lost"] == 1
    assert soak.audit(events + [{**replay, "incarnation": -1}], expected, WORLD)["lost"] == 0  # an older one
    twice = {**events[4], "ids": events[4]["ids"] + events[4]["ids"][:1]}
    assert soak.audit(events[:4] + [twice] + events[5:], expected, WORLD)["repeated"] == 1
    swapped = [dict(e) for e in events]
    swapped[4]["ids"], swapped[5]["ids"] = swapped[5]["ids"], swapped[4]["ids"]  # step 3: ranks 0 and 1 swapped
    assert soak.audit(swapped, expected, WORLD)["wrong_share"] == 2
    assert soak.audit(events[1:], expected, WORLD)["missing_steps"] == 1
