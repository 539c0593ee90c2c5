"""autoaccum: train at an exact global batch size on whatever memory the device has.

``import autoaccum`` initialises no CUDA and imports no optuna or matplotlib.
"""

from autoaccum.distributed import DistributedSync, broadcast_plan, init_from_env, wrap_model
from autoaccum.errors import AutoAccumError, DoesNotFitError, NonFiniteError, OptimizerStepOOMError, TaskError
from autoaccum.guard.guard import AccumulateResult, OOMGuard, PlanChange, StepResult
from autoaccum.memory import TrackedMemory, emulated_budget
from autoaccum.memory.chunked_loss import head_loss
from autoaccum.memory.model import MemoryModel
from autoaccum.memory.recovery import is_oom
from autoaccum.plan.plan import Plan
from autoaccum.plan.task import Task
from autoaccum.probe.report import Candidate, ProbeReport
from autoaccum.probe.run import probe
from autoaccum.search import SearchResult, SearchSpace, load_plan_file, search
from autoaccum.search.knobs import Knobs
from autoaccum.training.fit import FitConfig, FitResult, fit
from autoaccum.training.lr import LR_RULES, scale_adam_hparams, scale_lr
from autoaccum.units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "LR_RULES", "AccumulateResult", "AutoAccumError", "Candidate", "DistributedSync", "DoesNotFitError", "FitConfig",
    "FitResult", "Knobs", "MemoryModel", "NonFiniteError", "OOMGuard", "OptimizerStepOOMError", "Plan", "PlanChange",
    "ProbeReport", "SearchResult", "SearchSpace", "StepResult", "Task", "TaskError", "TrackedMemory", "broadcast_plan",
    "emulated_budget", "fit", "format_bytes", "head_loss", "init_from_env", "is_oom", "load_plan_file", "parse_bytes",
    "probe", "scale_adam_hparams", "scale_lr", "search", "wrap_model",
]
