"""``import autoaccum`` is cheap and side-effect free: no CUDA initialisation, no optuna, no matplotlib, and
none of the frameworks its integrations serve (transformers, lightning, accelerate)."""

import json
import subprocess
import sys

import autoaccum

CHECK = """
import json, sys
import torch

def state():
    return {"cuda_initialized": torch.cuda.is_initialized(), "optuna": "optuna" in sys.modules,
            "matplotlib": "matplotlib" in sys.modules, "transformers": "transformers" in sys.modules,
            "lightning": "lightning" in sys.modules, "accelerate": "accelerate" in sys.modules,
            "reporting": sorted(n for n in ("tensorboard", "wandb", "mlflow", "trl") if n in sys.modules)}

import autoaccum, autoaccum.cli, autoaccum.integrations
print(json.dumps(state()))
import matplotlib  # negative control: the same check sees an optional import
print(json.dumps(state()))
"""


def test_import_initialises_no_cuda_and_imports_no_optional_dependency():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    after_autoaccum, after_matplotlib = (json.loads(line) for line in result.stdout.splitlines())
    assert after_autoaccum == {"cuda_initialized": False, "optuna": False, "matplotlib": False, "transformers": False,
                               "lightning": False, "accelerate": False, "reporting": []}
    assert after_matplotlib["matplotlib"] is True


def test_public_surface():
    for name in ("probe", "ProbeReport", "Candidate", "Plan", "MemoryModel", "TrackedMemory", "emulated_budget",
                 "AutoAccumError", "DoesNotFitError", "TaskError", "Task", "is_oom", "parse_bytes", "format_bytes"):
        assert name in autoaccum.__all__ and hasattr(autoaccum, name), name
    assert issubclass(autoaccum.DoesNotFitError, autoaccum.AutoAccumError)
    assert isinstance(autoaccum.__version__, str)


def test_python_m_autoaccum_help():
    result = subprocess.run([sys.executable, "-m", "autoaccum", "probe", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0
    for option in ("--task", "--target-batch", "--budget", "--headroom", "--device", "--estimate", "--json",
                   "--plot", "--no-cache"):
        assert option in result.stdout


MISSING = """
import sys
for name in ("transformers", "lightning", "accelerate"):
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
for name in ("transformers", "lightning", "accelerate"):
    try:
        __import__(f"autoaccum.integrations.{name}")
    except ImportError as exc:
        print(str(exc))
"""


def test_an_integration_without_its_framework_names_the_extra_to_install():
    result = subprocess.run([sys.executable, "-c", MISSING], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "autoaccum.integrations.transformers needs Hugging Face transformers: pip install 'autoaccum[transformers]'",
        "autoaccum.integrations.lightning needs Lightning: pip install 'autoaccum[lightning]'",
        "autoaccum.integrations.accelerate needs Accelerate: pip install 'autoaccum[accelerate]'",
    ]
