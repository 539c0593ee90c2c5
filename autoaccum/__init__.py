"""autoaccum: train at an exact global batch size on whatever memory the device has.

``import autoaccum`` initialises no CUDA and imports no optuna or matplotlib.
"""

from autoaccum.errors import AutoAccumError, DoesNotFitError, OptimizerStepOOMError, TaskError
from autoaccum.fit import FitResult, fit
from autoaccum.guard import OOMGuard, PlanChange, StepResult
from autoaccum.lr import scale_lr
from autoaccum.memory import TrackedMemory, emulated_budget
from autoaccum.memory_model import MemoryModel
from autoaccum.oom import is_oom
from autoaccum.plan import Plan
from autoaccum.probe import Candidate, ProbeReport, probe
from autoaccum.task import Task
from autoaccum.units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "AutoAccumError", "Candidate", "DoesNotFitError", "FitResult", "fit", "scale_lr", "MemoryModel", "OOMGuard", "OptimizerStepOOMError", "Plan",
    "PlanChange", "ProbeReport", "StepResult", "Task", "TaskError",
    "TrackedMemory", "emulated_budget", "format_bytes", "is_oom", "parse_bytes", "probe",
]
