"""Variable-length data: a causal LM on long-tailed sequence lengths, cut into micro-batches by tokens.

Most sequences here are short and a few are up to eight times the median, as in most text
corpora. Sized for the longest sequence, a fixed micro-batch would be tiny for the short ones
(and padded to the longest in the batch); sized for the first batch, it runs out of memory on the
first long one. ``fit`` instead reads the lengths of the dataset, measures memory at the shortest,
the median and the longest length, fits ``peak(b, L)``, and cuts every global batch -- always
exactly ``target_batch`` sequences -- into micro-batches by a token budget: longest first, each
padded only to its own longest sequence, so a step of short sequences takes few passes and a step
with long ones takes more. The step is exact: the loss is summed over tokens and divided once by
the step's tokens. ``budget=`` emulates a small device on the CPU. Runs in seconds:

    python examples/variable_length.py
"""

from __future__ import annotations

import logging
import math
import random

import torch
import torch.nn.functional as F

import autoaccum
from autoaccum.demo import TinyGPT

VOCAB, LONGEST, PAD = 128, 192, 0


def make_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Counting sequences of long-tailed lengths: median about 24 tokens, a few up to LONGEST."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = min(LONGEST, max(4, int(rng.lognormvariate(math.log(24), 0.6))))
        start, stride = rng.randrange(1, VOCAB), rng.randrange(1, 5)
        rows.append({"input_ids": torch.tensor([1 + (start + stride * i) % (VOCAB - 1) for i in range(length)])})
    return rows


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pads to the longest row of the micro-batch; labels are -100 on padding."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), longest), PAD)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])], mask[i, :len(r["input_ids"])] = r["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy summed over the real tokens, and their count: normalised per step."""
    logits = model(batch["input_ids"][:, :-1])
    targets = batch["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum")
    return total, (targets != -100).sum()


def main() -> None:
    logging.basicConfig(format="%(message)s")
    logging.getLogger("autoaccum.fit").setLevel(logging.INFO)
    torch.manual_seed(0)
    rows = make_rows(512, seed=1)
    lengths = sorted(len(r["input_ids"]) for r in rows)
    print(f"{len(rows)} sequences: median {lengths[len(lengths) // 2]} tokens, longest {lengths[-1]}")
    model = TinyGPT(vocab_size=VOCAB, seq_len=LONGEST, dim=64, layers=2, heads=4)

    result = autoaccum.fit(model, rows, target_batch=64, loss_fn=token_loss, collate_fn=collate, lr=3e-3,
                           epochs=2, budget="14MiB")

    report = result.probe
    print(f"lengths from {report.lengths.source}; measured at lengths "
          f"{sorted({c.length for c in report.candidates})}, {report.probe_ooms} probe OOMs")
    print(f"plan: {result.plan.describe()}")
    passes = result.micro_steps
    print(f"micro-steps per optimizer step: {min(passes)} to {max(passes)} (mean {sum(passes) / len(passes):.1f})")
    print(f"{result.optimizer_steps} steps, {result.samples_seen:,} sequences; loss per token "
          f"{result.losses[0]:.3f} -> {result.final_loss:.3f}; {result.oom_events} OOMs in training; "
          f"peak {autoaccum.format_bytes(result.peak_bytes)} of 14 MiB")


if __name__ == "__main__":
    main()
