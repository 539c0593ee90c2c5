"""Where ``fit`` reports each step besides its own output: TensorBoard, Weights & Biases, MLflow, a
callable, and callbacks (``fit(..., report_to=..., callbacks=[...])``).

Each optimizer step's metrics are one flat dict (the metrics file's line: ``step``, ``loss``, ``lr``,
``micro_batch``, ``accum_steps``, ``ooms``, ``samples``, ``step_time_s``, ``peak_bytes``, ...; plus
``eval_loss`` at a step that evaluated). A callable in ``report_to`` gets that dict; a callback's
``on_step(metrics)`` too, and its ``on_end(result)`` the ``FitResult``. The backends get its numbers
as ``train/<name>`` (``eval/loss`` for evaluations) at the optimizer step: TensorBoard event files in
``report_dir``; W&B and MLflow in the run already active in the process (``wandb.init``,
``mlflow.start_run``), else in one started for the fit and ended with it, configured as the
libraries configure themselves (``WANDB_PROJECT``, ``WANDB_MODE``, ``WANDB_DIR``,
``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME`` ...). Only rank 0 reports. Each backend is an
optional extra, imported when a run asks for it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args

__all__ = ["BACKENDS", "Backend", "Reporter", "check_backends", "check_callbacks", "check_report_to"]

Backend = Literal["tensorboard", "wandb", "mlflow"]
BACKENDS: tuple[str, ...] = get_args(Backend)
#: the module each backend needs, and the extra that installs it
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
_EXCLUDED = ("step", "epoch")  # the step is the x axis; the epoch is no curve


def _targets(report_to: Any) -> list[Any]:
    if report_to is None:
        return []
    if isinstance(report_to, str) or callable(report_to):
        return [report_to]
    if isinstance(report_to, Sequence):
        return list(report_to)
    raise TypeError(f"report_to must be a backend name ({', '.join(map(repr, BACKENDS))}), a callable receiving each "
                    f"step's metrics dict, or a list of these; got a {type(report_to).__name__}")


def check_report_to(report_to: Any) -> None:
    """Raise TypeError/ValueError for a ``report_to`` that names no backend or holds something else."""
    targets = _targets(report_to)
    for target in targets:
        if isinstance(target, str):
            if target not in BACKENDS:
                raise ValueError(f"Invalid report_to: {target!r}. Allowed: {', '.join(map(repr, BACKENDS))}, or a "
                                 f"callable receiving each step's metrics dict")
        elif not callable(target):
            raise TypeError(f"report_to holds a {type(target).__name__}; each entry must be a backend name "
                            f"({', '.join(map(repr, BACKENDS))}) or a callable receiving each step's metrics dict")
    names = [t for t in targets if isinstance(t, str)]
    if len(set(names)) != len(names):
        raise ValueError(f"report_to names a backend twice: {names}")


def check_callbacks(callbacks: Any) -> None:
    """Raise TypeError for callbacks that are not a list of objects with ``on_step`` and/or ``on_end``."""
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Sequence):
        raise TypeError(f"callbacks must be a list of objects with on_step(metrics) and/or on_end(result), got a "
                        f"{type(callbacks).__name__}")
    for callback in callbacks:
        methods = [m for m in ("on_step", "on_end") if callable(getattr(callback, m, None))]
        if not methods:
            hint = "; a function belongs in report_to=" if callable(callback) else ""
            raise TypeError(f"callback {callback!r} has neither on_step(metrics) nor on_end(result){hint}")


def check_backends(report_to: Any) -> None:
    """Raise ImportError, naming the extra to install, for a backend whose package is missing (before any work)."""
    for target in _targets(report_to):
        if isinstance(target, str) and target in _PACKAGES:
            module, extra = _PACKAGES[target]
            if importlib.util.find_spec(module) is None:
                raise ImportError(f"report_to={target!r} needs the {module} package: pip install 'autoaccum[{extra}]'")


def _import(backend: str) -> Any:
    """The backend's module (imported here, when a run asks for it), or ImportError naming the extra."""
    module, extra = _PACKAGES[backend]
    try:
        if backend == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            return SummaryWriter
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"report_to={backend!r} needs the {module} package: pip install 'autoaccum[{extra}]' "
                          f"({exc})") from exc


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics as the backends' scalars: ``train/<name>``, ``eval/loss``; no None, no step or epoch."""
    out = {}
    for key, value in metrics.items():
        if key in _EXCLUDED or value is None or isinstance(value, str):
            continue
        name = "eval/loss" if key == "eval_loss" else f"train/{key}"
        out[name] = float(value)
    return out


class _TensorBoard:
    def __init__(self, log_dir: str | os.PathLike[str] | None) -> None:
        self.writer = _import("tensorboard")(log_dir=None if log_dir is None else os.fspath(log_dir))

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self, failed: bool) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, config: Mapping[str, Any]) -> None:
        wandb = _import("wandb")
        self.own = wandb.run is None  # a run the user started is theirs to finish
        self.run = wandb.init(config=dict(config)) if self.own else wandb.run

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        if self.own:
            self.run.finish(exit_code=1 if failed else 0)


class _MLflow:
    def __init__(self, config: Mapping[str, Any]) -> None:
        self.mlflow = _import("mlflow")
        self.own = self.mlflow.active_run() is None  # a run the user started is theirs to end
        if self.own:
            self.mlflow.start_run()
            self.mlflow.log_params(dict(config))

    def log(self, step: int, values: dict[str, float]) -> None:
        # MLflow's metric names allow "/" (as TensorBoard's tags do)
        self.mlflow.log_metrics(values, step=step)

    def close(self, failed: bool) -> None:
        if self.own:
            self.mlflow.end_run(status="FAILED" if failed else "FINISHED")


class Reporter:
    """The run's reporting targets on rank 0 (see the module docstring); nothing on other ranks.

    Args:
        report_to: backend names and/or callables (see ``check_report_to``).
        callbacks: objects with ``on_step(metrics)`` and/or ``on_end(result)``.
        report_dir: TensorBoard's log folder (default: ``runs/<time>_<host>``, as ``SummaryWriter``'s).
        config: the run's settings, recorded with W&B (``config``) and MLflow (parameters) runs it starts.
        rank: this process's rank; only rank 0 reports.
    """

    def __init__(self, report_to: Any, callbacks: Sequence[Any] = (), report_dir: str | os.PathLike[str] | None = None,
                 config: Mapping[str, Any] | None = None, rank: int = 0) -> None:
        self.backends: list[Any] = []
        self.functions: list[Callable[[dict[str, Any]], Any]] = []
        self.callbacks = list(callbacks) if rank == 0 else []
        if rank != 0:
            return
        try:
            for target in _targets(report_to):
                if not isinstance(target, str):
                    self.functions.append(target)
                elif target == "tensorboard":
                    self.backends.append(_TensorBoard(report_dir))
                elif target == "wandb":
                    self.backends.append(_Wandb(config or {}))
                else:
                    self.backends.append(_MLflow(config or {}))
        except BaseException:
            self.close(failed=True)  # the backends opened so far
            raise

    @property
    def active(self) -> bool:
        return bool(self.backends or self.functions or self.callbacks)

    def step(self, metrics: Mapping[str, Any]) -> None:
        """One optimizer step's metrics, to every target."""
        if not self.active:
            return
        values = _numbers(metrics)
        for backend in self.backends:
            backend.log(int(metrics["step"]), values)
        for function in self.functions:
            function(dict(metrics))  # a copy each: one target cannot change what the next one sees
        for callback in self.callbacks:
            on_step = getattr(callback, "on_step", None)
            if callable(on_step):
                on_step(dict(metrics))

    def evaluated(self, step: int, loss: float) -> None:
        """An evaluation outside a step's metrics (the one at the end of the run), to the backends."""
        for backend in self.backends:
            backend.log(step, {"eval/loss": float(loss)})

    def end(self, result: Any) -> None:
        """The run's ``FitResult``, to each callback's ``on_end``."""
        for callback in self.callbacks:
            on_end = getattr(callback, "on_end", None)
            if callable(on_end):
                on_end(result)

    def close(self, failed: bool = False) -> None:
        """Flush and close the backends (a W&B or MLflow run this fit started ends, marked failed on an error)."""
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close(failed)

