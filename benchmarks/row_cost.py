"""What the overlapped step's flag row costs the host as the number of ranks grows (issue 15, ranks).

The row rides in the last gradient bucket (``autoaccum.distributed.overlap``): the flags, then one
slot per rank for its step scalars and one for its cut row, every number in float32 pieces. Each
rank writes its own slots before the all-reduce and reads every rank's after it. Two ways, side by
side in one process (no process group: the row's layout does not depend on one), for several world
sizes:

- ``autoaccum``: the module's ``_write_row`` / ``_read_row``: the row zeroed and this rank's numbers
  put in place with three slice copies; read once to the host in float64 and added up with tensor
  operations (pieces, then a running sum over the ranks);
- ``per_element``: the design before it (kept here as the reference): the whole row built as a Python
  list and copied, and read back as a list whose scalars are added up in a Python loop over every
  rank's pieces.

Both must read back the same counts, the same float64 sums bit for bit and the same cut rows (checked
on a row summed over simulated ranks before timing). Per call: the median of ``--calls`` calls, in
alternating blocks. Prints a table, then one JSON document. Not part of the test run.

    python benchmarks/row_cost.py [--worlds 2 8 64 512] [--calls 2000] [--params 6] [--json-only]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from typing import Any

import torch

from autoaccum.distributed.overlap import _COUNTS, STEP_SCALARS, _OverlappedReduce, _pieces
from autoaccum.sync import CUT_FIELDS


def _row_of(rank: int, world_size: int, params: int) -> _OverlappedReduce:
    """The row's parts of one rank's overlap (no process group, no buckets: a float32 last bucket)."""
    o = object.__new__(_OverlappedReduce)
    o.rank, o.world_size, o.pieces = rank, world_size, 3
    o._flags = _COUNTS + params
    o.row = o._flags + world_size * (STEP_SCALARS + CUT_FIELDS) * o.pieces
    o.flats = [torch.zeros(66_000 + o.row)]  # a first layer's gradients before the row, as in ddp_bench
    return o


def per_element_write(o: _OverlappedReduce, flags: list[bool], scalars: torch.Tensor,
                      cut_row: tuple[int, ...]) -> None:
    """The design before: the whole row as a Python list, this rank's slots filled in, one copy."""
    pieces = o.pieces
    row = [float(f) for f in flags] + [0.0] * (o.row - len(flags))
    at = len(flags) + o.rank * STEP_SCALARS * pieces
    for value in scalars.reshape(-1).tolist():
        row[at:at + pieces] = _pieces(value, pieces)
        at += pieces
    at = o._rows_at() + o.rank * CUT_FIELDS * pieces
    for value in cut_row:
        row[at:at + pieces] = _pieces(float(value), pieces)
        at += pieces
    tail = o._tail()
    tail.copy_(torch.tensor(row, dtype=tail.dtype))


def per_element_read(o: _OverlappedReduce) -> tuple[list[float], torch.Tensor, tuple[tuple[int, ...], ...]]:
    """The design before: the flags and scalars read as one list, every rank's pieces added in Python."""
    tail, count, rows_at, pieces = o._tail(), o._flags, o._rows_at(), o.pieces
    head = tail[:rows_at].tolist()
    totals, at = [0.0] * STEP_SCALARS, count
    for _ in range(o.world_size):
        for i in range(STEP_SCALARS):
            value = 0.0
            for piece in head[at:at + pieces]:
                value += piece
            totals[i] += value
            at += pieces
    gathered = tail[rows_at:].view(o.world_size, CUT_FIELDS, pieces).to(torch.float64).sum(dim=2)
    rows = tuple(tuple(r) for r in gathered.round().to(torch.int64).tolist())
    return head[:count], torch.tensor(totals, dtype=torch.float64), rows


def _inputs(world_size: int, params: int) -> tuple[list[list[bool]], list[torch.Tensor], list[tuple[int, ...]]]:
    g = torch.Generator().manual_seed(world_size)
    flags = [[r == 0, False, False, True, False] + [True] * params for r in range(world_size)]
    scalars = [torch.randn(STEP_SCALARS, generator=g, dtype=torch.float64) * 1e3 for _ in range(world_size)]
    rows = [tuple(int(v) for v in torch.randint(0, 2**40, (CUT_FIELDS,), generator=g)) for _ in range(world_size)]
    return flags, scalars, rows


def _check(world_size: int, params: int) -> None:
    """Both ways write the same row and read back the same counts, sums (bit for bit) and rows."""
    flags, scalars, rows = _inputs(world_size, params)
    ways = {"autoaccum": [_row_of(r, world_size, params) for r in range(world_size)],
            "per_element": [_row_of(r, world_size, params) for r in range(world_size)]}
    read = {}
    for way, views in ways.items():
        for r, o in enumerate(views):
            if way == "autoaccum":
                o._write_row(flags[r], scalars[r], rows[r])
            else:
                per_element_write(o, flags[r], scalars[r], rows[r])
        summed = torch.stack([o._tail() for o in views]).sum(dim=0)
        views[0]._tail().copy_(summed)
        read[way] = views[0]._read_row(True, True) if way == "autoaccum" else per_element_read(views[0])
    (counts, sums, got), (counts2, sums2, got2) = read["autoaccum"], read["per_element"]
    if counts != counts2 or not torch.equal(sums, sums2) or got != got2 or got != tuple(rows):
        raise SystemExit(f"world {world_size}: the two ways read back different rows")


def _median_us(fn: Any, calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def measure(world_size: int, params: int, calls: int, blocks: int = 4) -> dict[str, Any]:
    _check(world_size, params)
    flags, scalars, rows = _inputs(world_size, params)
    new, old = _row_of(1, world_size, params), _row_of(1, world_size, params)
    fns = {"autoaccum": {"write": lambda: new._write_row(flags[1], scalars[1], rows[1]),
                         "read": lambda: new._read_row(True, True)},
           "per_element": {"write": lambda: per_element_write(old, flags[1], scalars[1], rows[1]),
                           "read": lambda: per_element_read(old)}}
    for parts in fns.values():  # warm up (the first calls allocate)
        for fn in parts.values():
            _median_us(fn, 200)
    spent: dict[str, dict[str, list[float]]] = {w: {"write": [], "read": []} for w in fns}
    for _ in range(blocks):  # alternating blocks: a slow moment hits both ways
        for way, parts in fns.items():
            for part, fn in parts.items():
                spent[way][part].append(_median_us(fn, calls // blocks))
    out: dict[str, Any] = {"world_size": world_size, "row_numbers": new.row}
    for way in fns:
        out[way] = {part: statistics.median(v) for part, v in spent[way].items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 8, 64, 512])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--params", type=int, default=6, help="parameters of the model (one presence flag each)")
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(w, args.params, args.calls) for w in args.worlds]
    result = {"benchmark": "row_cost", "calls": args.calls, "params": args.params, "rows": rows,
              "torch": torch.__version__, "python": platform.python_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if not args.json_only:
        print("ranks   row numbers   autoaccum write/read (us)   per-element write/read (us)   ratio (sum)")
        for r in rows:
            new, old = r["autoaccum"], r["per_element"]
            ratio = (old["write"] + old["read"]) / (new["write"] + new["read"])
            print(f"{r['world_size']:>5}   {r['row_numbers']:>11}   {new['write']:>11.1f} / {new['read']:<11.1f}"
                  f"   {old['write']:>13.1f} / {old['read']:<13.1f}   {ratio:.2f}x")
        print()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
