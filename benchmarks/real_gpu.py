"""Real GPU (issue 16): the probe, the plan, fit and the estimate, against the truth on a CUDA card.

Four models built from configs (no download): GPT-2 124M (512 tokens, padded, token-level loss),
ResNet-50 at 224 px (BatchNorm), ViT-B/16 at 224 px, and compare.py's 134M MLP. Each runs under three
squeezes that leave it the same memory: (i) a second process holds the rest of the card (autoaccum's
default budget), (ii) ``torch.cuda.set_per_process_memory_fraction`` (default budget), (iii) an
explicit ``budget=``. Per model and squeeze: the probe's limit against brute force (real accumulated
steps, twice, same squeeze), probe OOMs, the probe's cost in step-equivalents (one optimizer step of
the chosen plan, all its micro-batches), the pick's throughput against a sweep of the balanced plans at
the exact target, 50 steps of ``fit`` on the plan and their OOMs, and ``probe(estimate=True)``'s peak
against the measured peaks (allocated and reserved). Per model, optionally (needs optuna): the search
winner's speed-up over fp32 at the largest micro-batch. The method: the docstrings of
``benchmarks/realgpu/`` (models, squeeze, brute, parts, runner, report).

Resumable by model: each model's results go to ``<out>/<model>.json`` part by part; a rerun measures
only what is missing (``--redo`` measures everything again). A model takes a few minutes on an H100
(wall time per model in the output).

Prints a table, then one JSON document, and on CUDA writes the section "## Real GPU (issue 16)" of
benchmarks/RESULTS.md (``--results PATH`` elsewhere, ``--no-write`` not at all). On a CPU it is a smoke
run at small sizes under an emulated budget: squeeze (iii) only, (i) and (ii) skipped with their
reason, and RESULTS.md is never written. Needs transformers for the three Hugging Face models (the
``bench`` extra; without it they are skipped). Not part of the test run (tests/test_real_gpu.py runs
the CPU smoke).

Issue 40's rows (``--rows issue40``): the models people bring (ResNet-50 and ViT-B/16 in fp32 and bf16,
GPT-2 355M in bf16 at 1024 tokens, a 1.1B Llama-style decoder with a LoRA adapter at 2048 tokens), each
built on the device and squeezed by a second process only: the probe against brute force (one search from
the probe's answer), fit's OOMs and its samples/s against a hand-written loop at the same plan (rounds
interleaved in one process), the pick against a short sweep, and the estimate on fake cuda tensors (and on
fake cpu, as before) against the measured peaks. Nothing is written to RESULTS.md; benchmarks/gpu_rows40.sh
runs them row by row on a lent GPU.

    python benchmarks/real_gpu.py                                  # CUDA: all four models
    python benchmarks/real_gpu.py --models gpt2 --out gpu_out/real_gpu
    python benchmarks/real_gpu.py --size cpu --models mlp --fit-steps 5   # the CPU smoke
    python benchmarks/real_gpu.py --rows issue40 --models gpt2_355m_bf16 --out gpu_out/rows40
    python benchmarks/real_gpu.py --rows issue40 --size cpu --models gpt2_355m_bf16   # its CPU smoke
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parent)
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

from realgpu.cli import main  # noqa: E402 - needs benchmarks/ on the path

if __name__ == "__main__":
    sys.exit(main(__doc__))
