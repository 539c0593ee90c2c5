"""How far apart are a few micro-batches of a search_bench workload? (issue 15, item 5: reading a miss)

search_bench's goal compares the search's winner with the sweep's best by 7 interleaved readings each;
where the two are different sizes a few percent apart, that cannot say whether the gap is real. This
measures only the sizes given (the first is the reference), many rounds, interleaved (every size once a
round, the order rotating), each reading as search_bench's (guarded, accumulated steps at the exact
target under the workload's budget, 2 warm-up + 5 timed, samples/s from the fastest). Reported per
size: the median samples/s, the median per-round ratio to the reference with its standard error
(1.2533 x 1.4826 x MAD / sqrt(rounds)), and the slowest/fastest spread.

Prints a table, then one JSON document. Not part of the test run.

    python benchmarks/search_gap.py [--workload mlp|tiny-gpt] [--sizes 37,43,32] [--rounds 25] [--clock cpu]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys

import torch

from autoaccum.knobs import Knobs
from autoaccum.plan import Plan
from autoaccum.search.compare import paired_ratios
from autoaccum.throughput import make_bench
from results_md import markdown_table
from search_bench import HEADROOM, MEASURE, WORKLOADS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("tiny-gpt", "mlp"), default="mlp")
    parser.add_argument("--sizes", default="37,43,32", help="micro-batches, comma-separated; the first is the reference")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if len(sizes) < 2 or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        parser.error(f"--sizes {args.sizes!r}: give two or more distinct positive micro-batches, e.g. 37,43")
    if args.rounds < 3:
        parser.error(f"--rounds {args.rounds}: at least 3 (a median and its spread need them)")
    torch.set_num_threads(1)  # CPU time equals elapsed time only with one thread
    workload = next(w for w in WORKLOADS if w.name.startswith(args.workload))
    task = workload.make_task()
    bench = make_bench(task, None, workload.target_batch, int(workload.budget * (1 - HEADROOM)),
                       MEASURE["warmup_steps"], MEASURE["measure_steps"], clock=args.clock)
    load_before = os.getloadavg()
    runs: dict[int, list[float | None]] = {b: [] for b in sizes}
    for i in range(args.rounds):
        for b in sizes[i % len(sizes):] + sizes[:i % len(sizes)]:
            m = bench.run(b, Knobs())
            runs[b].append(m.samples_per_s if m.ok else None)
    rows = {}
    for b in sizes:
        read = [v for v in runs[b] if v is not None]
        ratios = paired_ratios(runs[b], runs[sizes[0]])
        ratio = statistics.median(ratios) if ratios else math.nan
        mad = statistics.median(abs(r - ratio) for r in ratios) if ratios else math.nan
        rows[b] = {"accum_steps": Plan.for_target(workload.target_batch, b).accum_steps,
                   "median_samples_per_s": statistics.median(read) if read else None, "readings": runs[b],
                   "paired_vs_reference": ratio,
                   "noise": 1.2533 * 1.4826 * mad / math.sqrt(len(ratios)) if ratios else math.nan,
                   "spread": min(read) / max(read) if read else None}
    doc = {"benchmark": "search_gap", "workload": workload.name, "clock": args.clock, "rounds": args.rounds,
           "reference": sizes[0], "sizes": rows, "torch": torch.__version__, "load_average_before": load_before,
           "load_average_after": os.getloadavg(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    table = [("micro", "accum", "samples/s (median)", f"paired vs {sizes[0]} ± noise", "spread")]
    for b, r in rows.items():
        table.append((str(b), str(r["accum_steps"]), f"{r['median_samples_per_s'] or 0:,.0f}",
                      f"{r['paired_vs_reference']:.3f} ± {r['noise']:.3f}", f"{r['spread'] or 0:.2f}"))
    print(f"{workload.name}: {args.rounds} interleaved rounds, {args.clock} clock")
    print(markdown_table(table))
    print()
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
