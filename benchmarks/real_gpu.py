"""Real GPU: the probe, the plan, fit and the estimate against the truth on a CUDA card.

The rows: ResNet-50 and ViT-B/16 in fp32 and bf16, GPT-2 355M in bf16 at 1024 tokens, a 1.1B
Llama-style decoder with LoRA at 2048 tokens, built on the device and squeezed by a second process:
the probe against brute force, fit's OOMs and samples/s against the hand-written loop, the pick against
a short sweep, the estimate against the measured peaks. Resumable by model (``<out>/<model>.json``, part
by part). On a CPU (``--size cpu``) a smoke run at small sizes under an emulated budget.
benchmarks/gpu_session.sh runs the rows one by one on a lent GPU.

    python benchmarks/real_gpu.py --models gpt2_355m_bf16 --out gpu_out/rows
    python benchmarks/real_gpu.py --report-only --size gpu --device cuda:0 --out DIR
    python benchmarks/real_gpu.py --size cpu --models gpt2_355m_bf16   # the CPU smoke
"""

from __future__ import annotations

import sys

from realgpu.cli import main

if __name__ == "__main__":
    sys.exit(main(__doc__))
