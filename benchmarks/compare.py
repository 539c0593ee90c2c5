"""Head-to-head: autoaccum against Accelerate, Lightning and the HF Trainer, measured in one run.

Every system trains the same seeded model on the same samples at the same global batch and memory
budget (run A), then again with the budget lowered after 2 steps (run B). ``gpt_long`` is a workload
where one sample does not fit without activation checkpointing: there each system's first step is the
question (no run B), and fit runs against a hand-configured run in one process. The code is the package
``benchmarks/headtohead/``; benchmarks/README.md gives the method and today's figures.

    python benchmarks/compare.py                 # CPU, mlp, gpt and cnn, a few minutes
    python benchmarks/compare.py --models gpt_long   # one sample does not fit, about 2 minutes
    python benchmarks/compare.py --models mlp --systems autoaccum hand --steps 4
    python benchmarks/compare.py --device cuda --size gpu   # on a GPU machine (real memory)
"""

from __future__ import annotations

import sys

from headtohead.cli import main

if __name__ == "__main__":
    sys.exit(main())
