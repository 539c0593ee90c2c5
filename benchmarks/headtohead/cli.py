"""The command line of ``python benchmarks/compare.py``; also the child process that runs one system
(``--child``, internal). Prints the table and the JSON document."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .report import table
from .runner import Config, Setup, run, run_child
from .systems import SYSTEMS

MIN_STEPS = 4  # optimizer steps per run: 2 before the budget drops in run B, and a steady state after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("tiny", "cpu", "gpu"), default="cpu")
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt", "cnn"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float64", "float32"), default=None,
                        help="parameter dtype (default float64 on CPU, float32 on CUDA)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads on CPU (default 1: stable timings on a shared machine)")
    parser.add_argument("--no-runtime-oom", action="store_true", help="skip run B (the budget drop)")
    parser.add_argument("--json-only", action="store_true")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="fixed memory budget in GiB for every model (e.g. 16, 24, 40 to emulate those cards on "
                             "a GPU); default: calibrated per model so a plain loop fits about a fifth of the target")
    parser.add_argument("--in-process", action="store_true", help="run every system in this process")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="save each model's results in DIR as it finishes and read back those made under the same "
                             "settings: a run that stops keeps what it finished (a GPU held for a limited time)")
    parser.add_argument("--redo", action="store_true", help="with --out: run again the models saved there")
    parser.add_argument("--rounds", type=int, default=5,
                        help="gpt_long, gpt_blocks (one sample does not fit): rounds of fit against the "
                             "hand-configured runs, alternating in one process (default 5; gpt_long 0: none)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one system's runs, JSON out
    args, rest = parser.parse_known_args(argv)
    if args.child is not None:
        return _child(Setup(**json.loads(args.child)), rest[0])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.device == "cuda":  # an index: set_per_process_memory_fraction refuses a bare "cuda"
        args.device = "cuda:0"
    if args.steps < MIN_STEPS:
        parser.error(f"--steps must be >= {MIN_STEPS} (the budget drops after 2 steps; steady state needs more)")
    config = Config(size=args.size, models=tuple(args.models), systems=tuple(args.systems), steps=args.steps,
                    device=args.device, runtime_oom=not args.no_runtime_oom,
                    dtype=args.dtype or ("float32" if args.device.startswith("cuda") else "float64"),
                    threads=args.threads, isolate=not args.in_process, budget_gib=args.budget_gib, out=args.out,
                    redo=args.redo, rounds=args.rounds)
    if config.device == "cpu":
        torch.set_num_threads(args.threads)
    log = (lambda s: None) if args.json_only else (lambda s: print(s, file=sys.stderr, flush=True))
    doc = run(config, log)
    if not args.json_only:
        print(table(doc["results"]))
        print()
    print(json.dumps(doc, indent=2, default=str))
    return 0


def _child(setup: Setup, system: str) -> int:
    if setup.device == "cpu":
        torch.set_num_threads(setup.threads)
    print(json.dumps(run_child(system, setup, freeze_gc=True), default=str))
    return 0
