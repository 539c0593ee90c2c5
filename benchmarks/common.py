"""What the single-file benchmarks share: a Markdown table, a command line (``--json-only``,
``--threads``) that runs the benchmark and prints its table and one JSON document, and the share of
the memory a hand-configured run may use."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Sequence

import torch

#: the share of the memory a hand-configured step may use: the probe keeps 10% free (its default headroom),
#: so a brute force that compares with it keeps the same
HEADROOM_KEPT = 0.9


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """``rows[0]`` is the header; columns padded to their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def context() -> dict:
    """Where and when a run was made: the machine, its load, torch, the date."""
    return {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_average": os.getloadavg()[0],
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def bench_main(doc: str, run: Callable[[], dict], table: Callable[[dict], str]) -> int:
    """Parse ``--json-only`` and ``--threads``, ``run()``, print the table and the JSON with the run's context."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--json-only", action="store_true", help="print only the JSON document")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: steadier timings on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = run()
    result.update(context(), total_wall_time_s=time.perf_counter() - started, threads=args.threads)
    if not args.json_only:
        print(table(result))
        print()
    print(json.dumps(result, indent=1))
    return 0
