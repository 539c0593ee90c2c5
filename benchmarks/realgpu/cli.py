"""The command line of ``python benchmarks/real_gpu.py``: run what is missing, print the table and JSON."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import report, table40
from .models import rows40, workloads
from .parts import Settings
from .runner import run_model

__all__ = ["main", "parse", "run"]

CPU_NOTE = ("CPU smoke run: small models under an emulated --budget (squeeze iii); squeezes (i) and (ii) need "
            "CUDA and were skipped.")
CPU_NOTE40 = ("CPU smoke run of the issue40 rows: small models under an emulated --budget (the other-process "
              "squeeze needs CUDA); fit against the hand loop on a CPU says nothing of a GPU.")


def parse(argv: list[str] | None = None, doc: str = __doc__) -> argparse.Namespace:
    """The options (see ``python benchmarks/real_gpu.py --help``)."""
    return _parser(doc).parse_args(argv)


def _parser(doc: str) -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--size", choices=("gpu", "cpu"), default="gpu" if cuda else "cpu",
                        help="gpu: the full-size models (default with CUDA); cpu: small configs, the smoke test")
    parser.add_argument("--device", default="cuda:0" if cuda else "cpu")
    parser.add_argument("--rows", choices=("issue16", "issue40"), default="issue16",
                        help="issue16: GPT-2 124M, ResNet-50, ViT-B/16, MLP under three squeezes (default); issue40: "
                             "ResNet-50 and ViT-B/16 fp32 and bf16, GPT-2 355M bf16, a 1.1B Llama-style decoder with "
                             "LoRA, under the other-process squeeze, with fit against a hand-written loop")
    parser.add_argument("--models", nargs="+", default=None,
                        help="default: every model of --rows (issue16: gpt2 resnet50 vit_b16 mlp)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of the per-model results files (default out/real_gpu/<size>)")
    parser.add_argument("--redo", action="store_true", help="measure again what the results files hold")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: the table and JSON from the results files as they are "
                             "(also on a machine without CUDA: give the --size and --device they were made with)")
    parser.add_argument("--fit-steps", type=int, default=None, help="steps of fit on each plan (default 50)")
    parser.add_argument("--search-trials", type=int, default=None, help="search trials (default 10; 4 on cpu)")
    parser.add_argument("--no-search", action="store_true", help="skip the optional Optuna search")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON document")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU (default 1)")
    return parser


def _versions() -> dict[str, str]:
    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = "not installed"
    return {"torch": torch.__version__, "transformers": hf, "python": platform.python_version()}


def run(args: argparse.Namespace, log: Any = lambda s: None) -> dict[str, Any]:
    """Measure what is missing of each model and gather the document."""
    device = torch.device(args.device)
    issue40 = getattr(args, "rows", "issue16") == "issue40"
    all_workloads = rows40(args.size) if issue40 else workloads(args.size)
    names = args.models or list(all_workloads)
    unknown = [n for n in names if n not in all_workloads]
    if unknown:
        raise ValueError(f"Invalid models: {unknown}. Allowed values: {', '.join(all_workloads)}")
    settings = Settings.for_size(args.size, args.fit_steps, args.search_trials,
                                 rows="issue40" if issue40 else "issue16")
    out = args.out or Path("out") / ("real_gpu40" if issue40 else "real_gpu") / args.size
    started = time.perf_counter()
    docs = [run_model(all_workloads[n], device, settings, args.size, out, redo=args.redo and not args.report_only,
                      search=not args.no_search, measure=not args.report_only, log=log) for n in names]
    rows = table40.rows(docs) if issue40 else report.rows(docs)
    measured_on = sorted({d["device_name"] for d in docs if d.get("device_name")})
    return {
        "version": 1, "kind": "autoaccum.bench.real_gpu" + ("40" if issue40 else ""), "size": args.size,
        "device": str(device),
        # --report-only may run where the files were not made (no CUDA here): the card the files name
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available()
        else " and ".join(measured_on) if args.report_only and measured_on else device.type, **_versions(),
        "out": str(out), "settings": settings.to_dict(), "cpu_smoke": device.type != "cuda",
        "note": (CPU_NOTE40 if issue40 else CPU_NOTE) if device.type != "cuda" else "",
        "targets": table40.targets(rows) if issue40 else report.targets(rows, settings.fit_steps),
        "per_model": [] if issue40 else report.model_lines(docs),
        "rows": rows, "models": docs, "total_wall_time_s": time.perf_counter() - started,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
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
        args.device = "cuda:0"  # set_per_process_memory_fraction wants an index
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    result = run(args, log=lambda s: print(s, file=sys.stderr, flush=True))
    issue40 = args.rows == "issue40"
    if not args.json_only:
        print(table40.table(result["rows"]) if issue40 else report.table(result["rows"]))
        print()
        if result["per_model"]:
            print("\n".join(result["per_model"]))
        print("\n".join([f"Targets (issue {'40' if issue40 else '16'}):", *result["targets"]])
              if not result["cpu_smoke"] else result["note"])
        print()
    print(json.dumps(result, indent=1, default=str))
    return 0
