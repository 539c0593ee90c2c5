"""What the single-file benchmarks share: a Markdown table, their own section of RESULTS.md, and the
command line (``--json-only``, ``--no-write``, ``--threads``) that prints a table and one JSON document."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """``rows[0]`` is the header; columns padded to their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def replace_section(title: str, section: str, path: Path = RESULTS) -> None:
    """Replace the section headed ``title`` (up to the next ``## ``) with ``section``, or append it; the
    other sections stay as they are."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find(title)
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(title))
        text = text[:start] + section + ("\n" + text[nxt + 1:] if nxt != -1 else "")
    path.write_text(text.rstrip("\n") + "\n")


SPEED = "## Speed (issue 15)"  # the section the issue-15 benchmarks write their sub-sections into


def write_subsection(title: str, text: str, section: str = SPEED, path: Path = RESULTS) -> None:
    """Replace the sub-section headed ``title`` (a ``### `` line, up to the next ``### `` or ``## ``) of the
    section headed ``section``, or add it at the end of that section; the section itself is appended at the
    end of the file where it is missing. Only that section is searched: a sub-section of the same title
    elsewhere in the file, and every other section, stay as they are."""
    doc = path.read_text() if path.exists() else "# Benchmark results\n"
    text = text.rstrip("\n") + "\n"
    head = doc.find("\n" + section + "\n")
    if head == -1:
        path.write_text(doc.rstrip("\n") + f"\n\n{section}\n\n" + text)
        return
    body = head + len(section) + 2
    nxt = doc.find("\n## ", body)
    end = len(doc) if nxt == -1 else nxt + 1
    start = doc.find("\n" + title + "\n", head, end)
    if start == -1:
        doc = doc[:end].rstrip("\n") + "\n\n" + text + ("\n" + doc[end:] if end < len(doc) else "")
    else:
        start += 1
        sub = doc.find("\n### ", start + len(title), end)
        stop = end if sub == -1 else sub + 1
        doc = doc[:start] + text + ("\n" + doc[stop:] if stop < len(doc) else "")
    path.write_text(doc.rstrip("\n") + "\n")


def bench_main(doc: str, script: str, run: Callable[[], dict], table: Callable[[dict], str],
               write_section: Callable[[dict, str], None]) -> int:
    """Parse the flags, ``run()``, add the run's context (wall time, threads, machine, date) to its
    document, print the table and the JSON, and write the section unless ``--no-write``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--json-only", action="store_true", help="print only the JSON document")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: steadier timings on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = run()
    result["total_wall_time_s"] = time.perf_counter() - started
    result["threads"] = args.threads
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    result["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if not args.json_only:
        print(table(result))
        print()
    print(json.dumps(result, indent=1))
    if not args.no_write:
        write_section(result, f"python benchmarks/{script}" + "".join(f" {a}" for a in sys.argv[1:]))
    return 0
