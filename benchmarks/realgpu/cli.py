"""The command line of ``python benchmarks/real_gpu.py``: run what is missing, print the table and JSON."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import context, version_of

from . import table
from .models import rows
from .parts import Settings
from .runner import run_model

__all__ = ["main", "parse", "run"]

CPU_NOTE = ("CPU smoke run: small models under an emulated budget (the other-process squeeze needs CUDA); "
            "fit against the hand loop on a CPU says nothing of a GPU.")


def parse(argv: list[str] | None = None, doc: str = __doc__) -> argparse.Namespace:
    """The options (see ``python benchmarks/real_gpu.py --help``)."""
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--size", choices=("gpu", "cpu"), default="gpu" if cuda else "cpu",
                        help="gpu: the full-size models (default with CUDA); cpu: small configs, the smoke test")
    parser.add_argument("--device", default="cuda:0" if cuda else "cpu")
    parser.add_argument("--models", nargs="+", default=None, help=f"default: every row ({', '.join(rows('cpu'))})")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of the per-model results files (default out/real_gpu/<size>)")
    parser.add_argument("--redo", action="store_true", help="measure again what the results files hold")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: the table and JSON from the results files as they are "
                             "(also on a machine without CUDA: give the --size and --device they were made with)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON document")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU (default 1)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, log: Any = lambda s: None) -> dict[str, Any]:
    """Measure what is missing of each model and gather the document."""
    device = torch.device(args.device)
    all_rows = rows(args.size)
    names = args.models or list(all_rows)
    unknown = [n for n in names if n not in all_rows]
    if unknown:
        raise ValueError(f"Invalid models: {unknown}. Allowed values: {', '.join(all_rows)}")
    settings = Settings.for_size(args.size)
    out = args.out or Path("out") / "real_gpu" / args.size
    started = time.perf_counter()
    docs = [run_model(all_rows[n], device, settings, args.size, out, redo=args.redo and not args.report_only,
                      measure=not args.report_only, log=log) for n in names]
    measured = [table.row(doc) for doc in docs]
    measured_on = sorted({d["device_name"] for d in docs if d.get("device_name")})
    return {
        "version": 2, "kind": "autoaccum.bench.real_gpu", **context(), "size": args.size, "device": str(device),
        # --report-only may run where the files were not made (no CUDA here): the card the files name
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available()
        else " and ".join(measured_on) if args.report_only and measured_on else device.type,
        "transformers": version_of("transformers"),
        "out": str(out), "settings": settings.to_dict(), "cpu_smoke": device.type != "cuda",
        "note": CPU_NOTE if device.type != "cuda" else "", "targets": table.targets(measured),
        "rows": measured, "models": docs, "total_wall_time_s": time.perf_counter() - started,
    }


def main(doc: str, argv: list[str] | None = None) -> int:
    args = parse(argv, doc)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    if args.device.startswith("cuda") and not torch.cuda.is_available() and not args.report_only:
        print("real_gpu.py: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.size == "gpu" and not args.device.startswith("cuda") and not args.report_only:
        print("real_gpu.py: --size gpu needs a CUDA device (hours on a CPU); the CPU smoke run is --size cpu",
              file=sys.stderr)
        return 2
    if args.device == "cuda":
        args.device = "cuda:0"  # the other process's squeeze names the card by its index
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    result = run(args, log=lambda s: print(s, file=sys.stderr, flush=True))
    if not args.json_only:
        print(table.table(result["rows"]))
        print()
        print("\n".join(["Targets:", *result["targets"]]) if not result["cpu_smoke"] else result["note"])
        print()
    print(json.dumps(result, indent=1, default=str))
    return 0
