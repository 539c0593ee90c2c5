"""The examples run on CPU and print their summary (each in its own interpreter, as a user runs them)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
NAMES = ("quickstart", "existing_loop", "token_lm", "variable_length") + \
    (("hf_causal_lm", "hf_vision") if HAVE_TRANSFORMERS else ())
needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="the Hugging Face examples need transformers")
pytestmark = pytest.mark.slow  # every example in its own interpreter: about 20 s


@pytest.fixture(scope="module")
def runs():
    """All examples, started together (their start-up, mostly importing torch, overlaps)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # on two shared cores, more threads only contend
    procs = {name: subprocess.Popen([sys.executable, str(EXAMPLES / f"{name}.py")], cwd=EXAMPLES.parent, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in NAMES}
    out = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        out[name] = (proc.returncode, stdout, stderr)
    return out


def _ok(runs, name):
    code, stdout, stderr = runs[name]
    assert code == 0, f"{name} exited {code}\n{stdout}\n{stderr}"
    return stdout, stderr


def test_quickstart(runs):
    stdout, stderr = _ok(runs, "quickstart")
    assert re.search(r"^plan: batch 256 = [\d x+]+ \(\d+ micro-batch(es)?\) \(from probe", stdout, re.MULTILINE), stdout
    assert "80 steps, 20,480 samples" in stdout and "train accuracy" in stdout
    assert "autoaccum fit ·" in stderr and "autoaccum fit done" in stderr  # banner and summary via logging


def test_existing_loop(runs):
    stdout, stderr = _ok(runs, "existing_loop")
    assert "step 2: OOM in " in stdout and ": batch 256 = 256 -> 128 x 2 (2 micro-batches)" in stdout  # AdamW's state
    assert "16 optimizer steps, 1 OOM(s) recovered" in stdout
    diff = float(stdout.rsplit("without OOMs: ", 1)[1].split()[0])
    assert diff < 1e-12  # the run that recovered from an OOM equals the one that never ran out


def test_token_lm(runs):
    stdout, stderr = _ok(runs, "token_lm")
    assert "48 steps; loss per token" in stdout and "held-out loss" in stdout
    first, last = (float(v) for v in stdout.split("loss per token ")[1].split(";")[0].split(" -> "))
    assert last < first / 2  # it learns
    assert "eval loss" in stderr


def _accumulating_plan(stdout: str) -> re.Match:
    """The plan line: ``plan: batch T = M x k + ... (A micro-batches...)``, adding up, with accumulation."""
    plan = re.search(r"^plan: batch (\d+) = ([\d x+]+) \((\d+) micro-batches", stdout, re.MULTILINE)
    assert plan is not None, stdout
    assert sum(eval(t.replace(" x ", " * ")) for t in plan[2].split(" + ")) == int(plan[1])
    assert int(plan[3]) > 1, f"the budget should force accumulation: {plan[0]}"
    return plan


def test_variable_length(runs):
    stdout, _ = _ok(runs, "variable_length")
    assert re.search(r"^plan: batch 64 cut by length: up to \d+ samples per micro-batch", stdout, re.MULTILINE), stdout
    assert "lengths from all 512 samples; measured at lengths [" in stdout and ", 0 probe OOMs" in stdout
    most = int(stdout.split("micro-steps per optimizer step: ")[1].split(" to ")[1].split(" ")[0])
    assert most > 1  # the budget forces accumulation
    assert "16 steps, 1,024 sequences" in stdout and "; 0 OOMs in training" in stdout
    first, last = (float(v) for v in stdout.split("loss per token ")[1].split(";")[0].split(" -> "))
    assert last < 0.5 * first


@needs_transformers
def test_hf_causal_lm(runs):
    stdout, stderr = _ok(runs, "hf_causal_lm")
    assert "256 rows of 8-48 tokens, GPT-2" in stdout
    # rows of 8-48 tokens: planned and cut by tokens, so a step's micro-steps follow its lengths
    assert re.search(r"^plan: batch 32 cut by length: up to \d+ samples per micro-batch", stdout, re.MULTILINE), stdout
    assert "(from probe:" in stdout
    most = int(stdout.split("micro-steps per optimizer step: ")[1].split(" to ")[1].split(" ")[0])
    assert most > 1  # the budget forces accumulation
    assert "16 steps, 512 sequences; loss per token" in stdout and "OOMs in training" in stdout
    first, last = (float(v) for v in stdout.split("loss per token ")[1].split(" (")[0].split(" -> "))
    assert last < 0.7 * first  # it learns, with the model's own loss and no loss_fn
    assert "autoaccum fit ·" in stderr and "autoaccum fit done" in stderr and "Traceback" not in stderr


@needs_transformers
def test_hf_vision(runs):
    stdout, stderr = _ok(runs, "hf_vision")
    plan = _accumulating_plan(stdout)
    assert plan[1] == "64" and "none below 2 samples)" in stdout  # BatchNorm: no micro-batch of one image
    assert "probe: 2 (ok, " in stdout  # the probe starts at 2, not at 1 (which cannot train)
    assert "16 steps, 1,024 images" in stdout and "0 OOMs in training" in stdout
    assert "UserWarning: BatchNorm layers (" in stderr and "Remedies:" in stderr  # the guard's note, once
    assert stderr.count("UserWarning") == 1 and "Traceback" not in stderr
