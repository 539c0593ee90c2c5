"""The command line: ``autoaccum probe`` (and ``autoaccum search`` with the search extra).

Only this module prints. ``--json`` keeps stdout for one JSON document; logs go to stderr. Without
``--task`` it probes the built-in demo (``autoaccum.demo``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from autoaccum import __version__
from autoaccum.errors import DoesNotFitError, TaskError
from autoaccum.memory.savers import describe_saver
from autoaccum.plan.task import Task
from autoaccum.precision import PRECISIONS
from autoaccum.probe.choice import plan_step_times
from autoaccum.probe.estimate import UntraceableError
from autoaccum.probe.report import REPORT_VERSION, ProbeReport
from autoaccum.probe.run import probe
from autoaccum.units import counted, format_bytes, parse_bytes
from autoaccum.validate import check_headroom, resolve_device

__all__ = ["EXIT_DOES_NOT_FIT", "EXIT_ERROR", "EXIT_OK", "EXIT_USAGE", "main"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_DOES_NOT_FIT = 0, 1, 2, 3


def _budget(text: str) -> int:
    try:
        return parse_bytes(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _headroom(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"Invalid headroom: {text!r}. Allowed range: 0 <= headroom < 1 "
                                         f"(a fraction of the budget kept free, e.g. 0.1)") from None
    try:
        return check_headroom(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {value}: allowed range 1 ~ any positive int")
    return value


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``probe`` and ``search`` share."""
    parser.add_argument("--task", metavar="MODULE:FUNCTION",
                        help="a function returning an autoaccum.Task (default: the built-in TinyGPT demo)")
    parser.add_argument("--target-batch", type=_positive_int, default=256, help="global batch (default 256)")
    parser.add_argument("--world-size", type=_positive_int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--budget", type=_budget, default=None,
                        help="memory budget, e.g. 8GiB, '8 GB', 8589934592 (default: what the device has free)")
    parser.add_argument("--headroom", type=_headroom, default=0.1, help="fraction of the budget kept free (0.1)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present, else cpu)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="measure under this precision: fp32, bf16 (autocast) or fp16 (autocast + GradScaler)")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout, nothing else")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log each measurement and the memory model's fit to stderr (debug)")


def load_task(spec: str, **kwargs: Any) -> Task:
    """Import ``module:function`` and call it (with ``kwargs``) to get a ``Task``.

    Raises:
        ValueError: the spec is not ``module:function``, the module or name is missing, or the
            function returns something other than a Task.
        TaskError: importing the module or calling the function raised; the spec, the file and the
            error are named (the original is chained).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"Invalid task {spec!r}: expected 'module:function', e.g. 'mytasks:make_task'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module ran (or was not found): say which task, where and what
        missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None and \
            f"{module_name}.".startswith(f"{exc.name}.")  # the module (or its package) itself, not an import in it
        if missing:
            raise ValueError(f"Invalid task {spec!r}: cannot import module {module_name!r} ({exc}); is it on "
                             f"PYTHONPATH or in the current directory?") from exc
        said = exc.msg if isinstance(exc, SyntaxError) else exc  # (its str repeats the file and line)
        raise TaskError(f"task {spec!r}: importing module {module_name!r} raised {type(exc).__name__}: {said}"
                        f"{_where(exc)}. Fix the module; python -c 'import {module_name}' shows the whole "
                        f"traceback") from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"Invalid task {spec!r}: module {module_name!r} has no callable {attr!r}")
    try:
        task = factory(**kwargs)
    except Exception as exc:
        raise TaskError(f"task {spec!r}: {attr}() raised {type(exc).__name__}: {exc}{_where(exc)}. Fix {attr} in "
                        f"{getattr(module, '__file__', module_name)}") from exc
    if not isinstance(task, Task):
        raise ValueError(f"Invalid task {spec!r}: {attr}() returned {type(task).__name__}, expected autoaccum.Task")
    return task


def _where(exc: BaseException) -> str:
    """`` (file:line)``: a syntax error's line, else the first line of the user's code in ``exc``'s traceback (the
    task module's line that raised, or that imported what raised); frames of this module and importlib skipped."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({exc.filename}:{exc.lineno})"
    skipped = (os.path.join(os.path.dirname(importlib.__file__), ""), "<")
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.filename != __file__ and not f.filename.startswith(skipped)]
    return f" ({frames[0].filename}:{frames[0].lineno})" if frames else ""


def resolve_task(spec: str | None, device: str | None) -> Task:
    """The user's task (``module:function``) or the demo, with its model moved to ``device``."""
    from autoaccum.demo import demo_task
    from autoaccum.plan.batch import move_to

    dev = resolve_device(device, "--device")
    if spec is None:
        return demo_task(dev)
    # The console script's sys.path[0] is its bin/ folder, not the working directory (which
    # ``python -m autoaccum`` puts first): a task module next to the user must import either way.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    task = load_task(spec)
    task.model.to(dev)
    make_batch = task.make_batch
    return Task(model=task.model, loss_fn=task.loss_fn, make_batch=lambda *size: move_to(make_batch(*size), dev),
                make_optimizer=task.make_optimizer, name=task.name, lengths=task.lengths)


#: a candidate's status in the table, in words
_STATUS_WORDS = {"ok": "fits", "over_budget": "too big", "oom": "OOM"}
#: how memory was read, in words
_METER_WORDS = {"tracked": "counting tensor bytes", "cuda": "the CUDA allocator"}


def _probe_table(report: ProbeReport) -> str:
    """One row per size. An estimate ran no real step, so it has no times."""
    share, smallest = report.plan.rank_batch(0), report.plan.min_micro_batch
    by_length = report.lengths is not None  # samples/s of a plan cut at one size says little there
    times = not report.is_estimate and not by_length
    head = (("length",) if by_length else ()) + ("micro-batch", "status", "peak", "forward/backward",
                                                "optimizer step") + \
        (("s per pass", "samples/s") if times else ("s per pass",) if by_length and not report.is_estimate else ())
    rows = [head]
    steps = plan_step_times(report.candidates, share, smallest) if times else {}
    for c in sorted(report.candidates, key=lambda c: (-(c.length or 0), c.micro_batch)):
        row = (str(c.length),) if by_length else ()
        row += (str(c.micro_batch), _STATUS_WORDS[c.status],
               "-" if c.peak_bytes is None else ("~" if c.status == "oom" else "") + format_bytes(c.peak_bytes),
               "-" if c.fwd_bwd_peak_bytes is None else format_bytes(c.fwd_bwd_peak_bytes),
               "-" if c.opt_peak_bytes is None else format_bytes(c.opt_peak_bytes))
        if not report.is_estimate:
            row += ("-" if c.micro_step_time_s is None else f"{c.micro_step_time_s:.4f}",)
        if times:
            step = steps.get(c.micro_batch)
            row += ("-" if not step else f"{share / step:,.0f}",)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def format_probe(report: ProbeReport) -> str:
    """The human report: header, candidate table, model, and the one-line recommendation.

    The table's samples/s is that of a whole optimizer step of the plan cut at each size (its
    passes, then the optimizer step), one rank's share per second."""
    lines = []
    kind = "ESTIMATE on fake cpu tensors (no step ran; CPU kernels differ from a GPU's)" if report.is_estimate \
        else f"measured by {_METER_WORDS.get(report.meter, report.meter)}"
    lines.append(f"autoaccum probe · {report.device} ({report.device_name}) · {report.precision} · {kind}")
    lines.append(f"budget {format_bytes(report.budget_bytes)} ({report.budget_source}), {report.headroom:.0%} kept "
                 f"free: plans for {format_bytes(report.usable_bytes)}"
                 + (" · from the cache: measured earlier for this model, device and budget (--refresh measures "
                    "again)" if report.source == "cache" else ""))
    lines.append("")
    lines.append(_probe_table(report))
    lines.append("")
    if report.lengths is not None:
        p = report.lengths
        lines.append(f"lengths: {p.shortest} to {p.longest}, median {p.median} ({p.source})")
    if report.token_model is not None:
        t = report.token_model
        square = f" + {format_bytes(t.per_token_sq_bytes)} x L^2" if t.per_token_sq_bytes else ""
        each = f"{format_bytes(t.per_sample_bytes)} + " if round(t.per_sample_bytes) else ""
        per = f"{each}{format_bytes(t.per_token_bytes)} x L{square}"
        lines.append(f"memory: {format_bytes(t.base_bytes)} + {f'({per})' if each or square else per} for each "
                     f"sample of length L (the optimizer step needs {format_bytes(t.opt_peak_bytes)})")
    elif report.model is not None:
        m = report.model
        lines.append(f"memory: {format_bytes(m.base_bytes)} + {format_bytes(m.per_sample_bytes)} per sample (the "
                     f"optimizer step needs {format_bytes(m.opt_peak_bytes)})")
    if report.is_estimate:
        lines.append(f"estimate: {counted(len(report.candidates), 'size')} on fake tensors, {report.wall_time_s:.2f} s")
    else:
        ooms = "none" if not report.probe_ooms else f"{report.probe_ooms:,}"
        lines.append(f"probe: {counted(report.probe_steps, 'forward/backward pass', 'forward/backward passes')} and "
                     f"{counted(report.optimizer_steps, 'optimizer step')} in {report.wall_time_s:.2f} s, {ooms} ran "
                     f"out of memory")
    plan = report.plan
    for saver, needed in report.savers_tried:
        lines.append(f"micro-batch {plan.min_micro_batch} did not fit "
                     f"{'without a memory saver' if saver == 'none' else f'with {describe_saver(saver)}'} (needs "
                     f"{'?' if needed is None else 'at least ' + format_bytes(needed)}); measured again with the next "
                     f"memory saver")
    if len(report.savers_weighed) > 1:
        share = plan.rank_batch(0)
        lines.append("weighed: " + "; ".join(
            f"{'no memory saver' if saver == 'none' else describe_saver(saver)} at micro-batch {micro}"
            + ("" if not seconds else f" · {share / seconds:,.0f} samples/s")
            for saver, micro, seconds in report.savers_weighed))
    # the plan is cut evenly from the size it was chosen at: the smallest measured size that covers it
    chosen = min((c for c in report.candidates if c.status == "ok" and c.micro_batch >= plan.micro_batch),
                 key=lambda c: c.micro_batch, default=None)
    step = None if chosen is None or report.is_estimate or report.lengths is not None else \
        plan_step_times(report.candidates, plan.rank_batch(0), plan.min_micro_batch).get(chosen.micro_batch)
    speed = "" if not step or report.lengths is not None else f" · {plan.rank_batch(0) / step:,.0f} samples/s"
    peak = "" if report.model is None or report.lengths is not None else \
        f" · peak {'~' if report.is_estimate else ''}{format_bytes(report.model.predict(plan.micro_batch))} " \
        f"of {format_bytes(report.budget_bytes)}"
    lines.append(plan.describe() + speed + peak)
    return "\n".join(lines)


def _cmd_probe(args: argparse.Namespace) -> int:
    if args.plot:  # before the probe: a plot that cannot be written should not cost a probe first
        from autoaccum.probe.plot import check_plot_path

        check_plot_path(args.plot)
    task = resolve_task(args.task, args.device)
    try:
        report = probe(task, target_batch=args.target_batch, world_size=args.world_size, budget=args.budget,
                       headroom=args.headroom, precision=args.precision, max_micro_batch=args.max_micro_batch,
                       estimate=args.estimate, cache=not args.no_cache, refresh=args.refresh,
                       cache_dir=args.cache_dir, progress=not args.verbose)
    except UntraceableError as exc:  # a TaskError: main prints it; here it is told which task it was
        named = "the demo task" if args.task is None else f"task {args.task!r} ({task.name!r})"
        raise UntraceableError(f"{named}: {exc}") from exc.__cause__
    except DoesNotFitError as exc:
        if args.json:
            print(json.dumps({"kind": "autoaccum.probe", "version": REPORT_VERSION, "error": "does_not_fit",
                              "needed_bytes": exc.needed_bytes, "available_bytes": exc.available_bytes,
                              "suggestions": list(exc.suggestions)}))
        print(f"autoaccum: {exc}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(format_probe(report))
    if args.plot:
        from autoaccum.probe.plot import plot_probe

        plot_probe(report, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return EXIT_OK


def _cmd_search(args: argparse.Namespace) -> int:
    from autoaccum.search import SearchError, format_search, require_optuna, search

    require_optuna()  # before the probe: a missing extra should not cost a probe first
    if not args.verbose:
        logging.getLogger("optuna").setLevel(logging.WARNING)  # one INFO line per trial otherwise
    task = resolve_task(args.task, args.device)
    try:
        report = probe(task, target_batch=args.target_batch, world_size=args.world_size, budget=args.budget,
                       headroom=args.headroom, precision=args.precision, max_micro_batch=args.max_micro_batch,
                       cache=not args.no_cache, refresh=args.refresh, cache_dir=args.cache_dir,
                       progress=not args.verbose)
        result = search(task, args.target_batch, world_size=args.world_size, report=report, n_trials=args.n_trials,
                        timeout_s=args.timeout, storage=args.storage, study_name=args.study_name,
                        patience=args.patience, seed=args.seed)
    except (DoesNotFitError, SearchError) as exc:
        if args.json:
            print(json.dumps({"kind": "autoaccum.search", "version": 1, "error": "does_not_fit", "message": str(exc)}))
        print(f"autoaccum: {exc}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    print(json.dumps(result.to_dict(), indent=1) if args.json else format_search(result))
    if args.out:
        print(f"plan written to {result.save(args.out)}", file=sys.stderr)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoaccum", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version",
                        version=f"autoaccum {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe", help="measure training steps, fit the memory model, print the plan")
    add_task_arguments(p)
    p.add_argument("--max-micro-batch", type=_positive_int, default=None, help="largest size to try")
    p.add_argument("--estimate", action="store_true", help="fake-tensor estimate instead of a measurement")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="plot memory vs micro-batch (plot extra)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the probe cache")
    p.add_argument("--refresh", action="store_true", help="measure again and replace the cached result")
    p.add_argument("--cache-dir", default=None, help="where probe results are cached (~/.cache/autoaccum)")
    p.set_defaults(handler=_cmd_probe)
    s = sub.add_parser("search", help="measure micro-batches and knobs with Optuna: the fastest that fits "
                                      "(search extra)")
    add_task_arguments(s)
    s.add_argument("--max-micro-batch", type=_positive_int, default=None, help="largest size the probe tries")
    s.add_argument("--no-cache", action="store_true", help="neither read nor write the probe cache")
    s.add_argument("--refresh", action="store_true", help="probe again and replace the cached result")
    s.add_argument("--cache-dir", default=None, help="where probe results are cached (~/.cache/autoaccum)")
    s.add_argument("--n-trials", type=_positive_int, default=20, help="most trials to run (default 20)")
    s.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="stop starting trials after this")
    s.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna storage, e.g. sqlite:///autoaccum.db (resumes the study)")
    s.add_argument("--study-name", default=None, help="study to create or resume (default: from task and device)")
    s.add_argument("--patience", type=_positive_int, default=8, help="stop after this many trials without gain (8)")
    s.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    s.add_argument("--out", metavar="PLAN.json", default=None, help="write the winner as a plan file")
    s.set_defaults(handler=_cmd_search)
    return parser


def _attach_negative_values(argv: Sequence[str]) -> list[str]:
    """``--budget -1GiB`` as ``--budget=-1GiB``: argparse takes a token that starts with ``-`` and is not a plain
    number for an option and says "expected one argument"; joined, the value reaches its check, which names
    the allowed range. No option of autoaccum's starts with ``-`` and a digit, so such a token is a value."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_attach_negative_values(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(name)s: %(message)s")
    if args.verbose:  # each measurement, the memory model's fit: details logged at debug level
        logging.getLogger("autoaccum").setLevel(logging.DEBUG)
    try:
        return args.handler(args)
    except (ValueError, TypeError, ImportError) as exc:
        print(f"autoaccum: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, (ValueError, TypeError)) else EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
