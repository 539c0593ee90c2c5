"""Head-to-head (issue 7): autoaccum against the tools users would pick instead, measured in one run.

The code is the package ``benchmarks/headtohead/``; what each system does, the memory budget, the
columns and the measurement choices are written up in benchmarks/RESULTS.md, section "Head-to-head
(issue 7)", with the results. Not part of the test run (tests/test_compare.py smoke-tests a tiny
configuration).

Run it::

    python benchmarks/compare.py                 # CPU, all three models, a few minutes
    python benchmarks/compare.py --models mlp --systems autoaccum hand --steps 4
    python benchmarks/compare.py --device cuda --size gpu   # on a GPU machine (real memory)

Prints a table, then one JSON document, and rewrites that section of RESULTS.md (``--no-write`` to skip).
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parent)
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

from headtohead.cli import main  # noqa: E402 - needs benchmarks/ on the path

if __name__ == "__main__":
    sys.exit(main())
