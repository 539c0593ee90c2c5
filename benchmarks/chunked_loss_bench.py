"""The loss in chunks: what it saves and costs at the same micro-batch, what fit gains from it under a budget, and
that the probe leaves it where it does not pay.

A GPT-2-shaped Hugging Face model (``GPT2LMHeadModel``, vocabulary 50,257, small width, its own loss). Rows:

- ``same micro-batch``: 2 x 1,024 tokens, with and without ``chunked_loss`` (chunks of the default fewest positions,
  and of 16, 256 and 1,024): the step's peak (tracked meter) and its time (forward, backward, AdamW; median of
  ``--repeats``, alternating);
- ``under a budget``: fit with nothing configured against the best hand-configured run without the rung: the
  largest micro-batch that fits 90% of the budget (as the probe's headroom keeps free) with no saver and with
  every block checkpointed, found by brute force; each trains ``--steps`` steps of the target batch (the
  benchmarks' hand loop, token-exact, under the budget emulated as fit's steps are on a CPU), alternating over
  ``--rounds`` rounds; samples/s of training steps (fit's own figure, its probe excluded);
- ``small vocabulary``: the demo's shape (vocabulary 256, 64 tokens, width 128) under a budget where a saver is
  weighed: fit's plan, and whether it took the rung.

    python benchmarks/chunked_loss_bench.py [--rounds 3] [--steps 3] [--repeats 5] [--json-only]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from common import HEADROOM_KEPT, bench_main, hand_step, largest_fitting, markdown_table, micro_batches, quiet

import autoaccum
from autoaccum.memory import chunked_loss
from autoaccum.memory.chunked_loss import loss_only
from autoaccum.memory.savers import apply_saver
from autoaccum.memory.tracked import TrackedMemory


def gpt2(vocab: int = 50257, width: int = 64, positions: int = 1024) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=width, n_head=2, vocab_size=vocab, n_positions=positions))


def tokens(rows: int, length: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def own_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's own loss as a token sum and its count, for the hand loop (token-exact, as fit weighs it); read for the
    loss alone, as autoaccum's own loss reads it (so that the saver may chunk it)."""
    count = (batch["labels"][:, 1:] != -100).sum()
    with loss_only():
        return model(**batch, num_items_in_batch=1).loss, count


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, saver: str, micro: int,
         budget: int | None = None) -> int:
    """One hand-configured step of ``batch`` at ``micro`` with ``saver``; its peak (under ``budget``, emulated)."""
    with TrackedMemory(budget) as meter, apply_saver(model, saver):
        meter.track(model, optimizer)
        hand_step(model, optimizer, micro_batches(batch, micro), own_loss)
    return meter.read().peak_bytes


def same_micro(repeats: int, sizes: tuple[int, ...] = (16, 256, 1024)) -> dict[str, Any]:
    """The whole loss against chunks of the default fewest positions (``MIN_CHUNK_ROWS``) and of ``sizes``."""
    model, batch = gpt2(), tokens(2, 1024, 50257)
    optimizer = torch.optim.AdamW(model.parameters())
    variants = ("none", chunked_loss.MIN_CHUNK_ROWS, *sizes)
    default, peaks, times = chunked_loss.MIN_CHUNK_ROWS, {}, {v: [] for v in variants}
    try:
        for i in range(repeats + 1):  # the first round measures the peaks (under the tracked meter)
            for variant in variants if i % 2 == 0 else tuple(reversed(variants)):
                saver = "none" if variant == "none" else "chunked_loss"
                chunked_loss.MIN_CHUNK_ROWS = default if variant == "none" else variant
                if i == 0:
                    peaks[variant] = step(model, optimizer, batch, saver, 2)
                    continue
                started = time.perf_counter()
                with apply_saver(model, saver):
                    hand_step(model, optimizer, [batch], own_loss)
                times[variant].append(time.perf_counter() - started)
    finally:
        chunked_loss.MIN_CHUNK_ROWS = default
    step_s = {v: statistics.median(t) for v, t in times.items()}
    ratios = {v: {"peak_ratio": peaks[v] / peaks["none"], "time_ratio": step_s[v] / step_s["none"]}
              for v in variants[1:]}
    return {"peaks": {str(v): p for v, p in peaks.items()}, "step_s": {str(v): t for v, t in step_s.items()},
            "min_chunk_rows": default, **ratios[default], "by_min_chunk_rows": ratios}


def under_budget(budget: int, target: int, steps: int, rounds: int, length: int, vocab: int,
                 width: int) -> dict[str, Any]:
    data = tokens(target * steps, length, vocab)

    def fits(saver: str, micro: int) -> bool:
        model = gpt2(vocab, width, max(length, 64))
        optimizer = torch.optim.AdamW(model.parameters())
        try:  # two steps of the target batch: the second holds AdamW's state, every pass after the first the grads
            for _ in range(2):
                step(model, optimizer, tokens(target, length, vocab), saver, micro, int(budget * HEADROOM_KEPT))
            return True
        except torch.OutOfMemoryError:
            return False

    hands = {s: largest_fitting(lambda m, s=s: fits(s, m), target)[0] for s in ("none", "checkpointing")}
    rates: dict[str, list[float]] = {"fit": [], **{f"hand {s} x {m}": [] for s, m in hands.items() if m}}
    plans = set()
    for index in range(rounds):
        for name in list(rates) if index % 2 == 0 else list(reversed(rates)):
            model = gpt2(vocab, width, max(length, 64))
            optimizer = torch.optim.AdamW(model.parameters())
            if name == "fit":
                with quiet():
                    result = autoaccum.fit(model, data, target, optimizer=optimizer, budget=budget, epochs=1,
                                           progress=False)
                rates[name].append(result.samples_per_s)
                plans.add(result.plan.describe())
                continue
            saver, micro = name.split()[1], int(name.split()[-1])
            started = time.perf_counter()
            for i in range(steps):  # under the budget emulated, as fit's steps run on a CPU
                step(model, optimizer, {k: v[i * target:(i + 1) * target] for k, v in data.items()}, saver, micro,
                     budget)
            rates[name].append(target * steps / (time.perf_counter() - started))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    best = max((n for n in medians if n != "fit"), key=medians.get, default=None)  # type: ignore[arg-type]
    return {"budget": budget, "hand_largest": hands, "samples_per_s": medians, "best_hand": best,
            "fit_over_best": medians["fit"] / medians[best] if best else None, "fit_plans": sorted(plans)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    return {"same_micro": same_micro(args.repeats),
            **{f"under_budget_{mib}": under_budget(mib * 2**20, 8, args.steps, args.rounds, 512, 50257, 64)
               for mib in (400, 600)},
            "small_vocabulary": under_budget(24 * 2**20, 64, args.steps, args.rounds, 64, 256, 128)}


def table(result: dict[str, Any]) -> str:
    same = result["same_micro"]
    rows = [["row", "figure", "value"]]
    for size, r in same["by_min_chunk_rows"].items():
        rows += [[f"same micro-batch (2 x 1,024 tokens), chunks of {size}+", "peak / time, chunked over whole",
                  f"{r['peak_ratio']:.3f} / {r['time_ratio']:.3f}" + (" (default)" if size == same["min_chunk_rows"]
                                                                     else "")]]
    for key in [k for k in result if k.startswith("under_budget")] + ["small_vocabulary"]:
        r = result[key]
        label = "GPT-2's vocabulary, 8 x 512 tokens" if key.startswith("under") else "the demo's shape, 64 x 64 tokens"
        rows += [[f"{label}, budget {autoaccum.format_bytes(r['budget'])}", "fit's plan", "; ".join(r["fit_plans"])],
                 ["", f"fit samples/s / best hand-configured without it ({r['best_hand'] or 'none fits'})",
                  f"{r['fit_over_best']:.3f}" if r["fit_over_best"] else "-"]]
    return markdown_table(rows)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, table, options))
