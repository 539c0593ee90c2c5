"""Memory vs micro-batch: measured peaks, the fitted model and the budget (needs the plot extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autoaccum.probe.run import ProbeReport

__all__ = ["check_plot_path", "plot_probe"]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'autoaccum[plot]'") from exc
    return plt


def check_plot_path(path: str, name: str = "--plot") -> None:
    """Before any measurement: matplotlib is there, and ``path`` is a file in a directory that exists.

    Raises:
        ImportError: matplotlib is missing (the plot extra).
        ValueError: the directory does not exist, or ``path`` is one.
    """
    _pyplot()
    target = Path(path).expanduser()
    if target.is_dir():
        raise ValueError(f"Invalid {name} {path!r}: it is a directory. Allowed: a file path in an existing directory, "
                         f"e.g. {str(target / 'probe.png')!r}")
    if not target.parent.is_dir():
        raise ValueError(f"Invalid {name} {path!r}: its directory {str(target.parent)!r} does not exist. Allowed: a "
                         f"file path in an existing directory; create it first (mkdir -p {target.parent}) or choose "
                         f"another path")


def plot_probe(report: ProbeReport, path: str) -> None:
    """Write a PNG of the probe's measurements, its fitted model and the budget lines to ``path``."""
    plt = _pyplot()
    gib = 2**30
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for status, marker, color in (("ok", "o", "tab:green"), ("over_budget", "s", "tab:orange"),
                                  ("oom", "x", "tab:red")):
        pts = [c for c in report.candidates if c.status == status and c.peak_bytes is not None]
        if pts:
            ax.scatter([c.micro_batch for c in pts], [c.peak_bytes / gib for c in pts], marker=marker,
                       color=color, label=f"measured: {status}" if not report.is_estimate else f"estimated: {status}",
                       zorder=3)
    top = max(c.micro_batch for c in report.candidates)
    if report.model is not None:
        xs = list(range(1, int(top * 1.2) + 2))
        ax.plot(xs, [report.model.predict(x) / gib for x in xs], color="tab:blue",
                label="model: max(opt_peak, base + per_sample x b)")
    ax.axhline(report.budget_bytes / gib, color="black", linestyle="--", label="budget")
    ax.axhline(report.usable_bytes / gib, color="gray", linestyle=":", label=f"budget - {report.headroom:.0%} headroom")
    ax.axvline(report.plan.micro_batch, color="tab:purple", alpha=0.4,
               label=f"plan: micro-batches of up to {report.plan.micro_batch}")
    ax.set_xlabel("micro-batch size")
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title(f"autoaccum probe · {report.device_name}" + (" (estimate)" if report.is_estimate else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
