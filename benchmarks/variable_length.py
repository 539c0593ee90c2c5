"""Variable-length benchmark: four ways to cut long-tailed sequences, on the same data, in one run.

TinyGPT (2 blocks, dim 64, up to 256 tokens) on sequences of median 32 tokens with 1% of 6-8x that,
an exact global batch of 64 sequences, a token-level loss, one emulated budget. The variants see the
same global batches, steps interleaved: (a) ``fixed-longest``: padded to the batch's longest and cut
at a fixed size that fits the longest length; (b) ``first-batch``: the plan the probe makes from the
first global batch; (c) ``grouped``: (a)'s size, sorted by length, each micro-batch padded to its own
longest; (d) ``token-budget``: autoaccum's plan from the data's lengths, micro-batches cut by tokens.
Reported: real tokens/s, OOMs in training, padding, micro-steps per step.

    python benchmarks/variable_length.py [--json-only] [--threads N]
"""

from __future__ import annotations

import copy
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' padded rows

from common import bench_main, markdown_table
from helpers import pad_rows as collate
from helpers import padded_token_loss as token_loss

import autoaccum
from autoaccum import OOMGuard, Plan, TrackedMemory
from autoaccum.demo import TinyGPT
from autoaccum.plan.batch import Samples
from autoaccum.plan.cut import SampleCut, TokenCut

VOCAB, LONGEST, MEDIAN = 128, 256, 32
TARGET, STEPS, BUDGET, HEADROOM = 64, 24, "40MiB", 0.1
VARIANTS = ("fixed-longest", "first-batch", "grouped", "token-budget")


def make_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Long-tailed lengths: log-normal around MEDIAN, and 1% long ones of 6-8x the median."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(6 * MEDIAN, LONGEST) if i % 100 == 37 else \
            min(LONGEST, max(4, int(rng.lognormvariate(math.log(MEDIAN), 0.5))))
        start, stride = rng.randrange(1, VOCAB), rng.randrange(1, 5)
        rows.append({"input_ids": torch.tensor([1 + (start + stride * k) % (VOCAB - 1) for k in range(length)])})
    return rows


def length_of(row: dict[str, torch.Tensor]) -> int:
    return len(row["input_ids"])


def global_batches(rows: list[dict]) -> tuple[list[list[dict]], int]:
    """The steps' samples, and the order's seed: the first permutation (seeds 0, 1, ...) whose first
    global batch holds no sequence longer than 3x the median (a first batch with a long sequence makes (b)
    plan as (a))."""
    for seed in range(1000):
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
        if max(length_of(rows[i]) for i in order[:TARGET]) <= 3 * MEDIAN:
            break
    return [[rows[i] for i in order[s * TARGET:(s + 1) * TARGET]] for s in range(STEPS)], seed


def computed_tokens(items: list[dict], plan: Plan, by_tokens: bool) -> int:
    """Token positions the micro-batches of the final plan compute (real and padding)."""
    lengths = [length_of(r) for r in items]
    if not by_tokens:  # one padded global batch, cut by samples: every row padded to the batch's longest
        return len(items) * max(lengths)
    cut = TokenCut()
    return sum(len(g) * max(lengths[i] for i in g) for g in cut.groups(Samples(tuple(items), tuple(lengths),
                                                                               collate), plan))


class Variant:
    """One way of cutting: a model copy, its optimizer and guard under its own emulated budget."""

    def __init__(self, name: str, model: torch.nn.Module, plan: Plan, by_tokens: bool) -> None:
        self.name, self.by_tokens = name, by_tokens
        self.model = copy.deepcopy(model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.meter = TrackedMemory(budget_bytes=autoaccum.parse_bytes(BUDGET)).track(self.model, self.optimizer)
        self.guard = OOMGuard(self.model, self.optimizer, plan=plan, meter=self.meter, log_changes=False,
                              cut=TokenCut() if by_tokens else SampleCut())
        self.start_plan = plan
        self.times: list[float] = []
        self.real = self.computed = 0
        self.passes: list[int] = []
        self.peak = 0

    def step(self, items: list[dict], index: int) -> None:
        batch = Samples(tuple(items), tuple(length_of(r) for r in items), collate) if self.by_tokens \
            else collate(items)
        started = time.perf_counter()
        with self.meter:
            result = self.guard.step(batch, token_loss)
        if index > 0:  # the first step creates AdamW's state: not timed
            self.times.append(time.perf_counter() - started)
            self.real += int(result.num_items or 0)
        self.computed += computed_tokens(items, self.guard.plan, self.by_tokens)
        self.passes.append(result.micro_steps)
        self.peak = max(self.peak, result.peak_bytes or 0)

    def summary(self, rows: list[list[dict]]) -> dict:
        real_all = sum(sum(length_of(r) for r in items) for items in rows)
        return {"plan": self.start_plan.describe(), "final_plan": self.guard.plan.describe(),
                "tokens_per_s": self.real / sum(self.times), "ooms": self.guard.ooms,
                "padding": 1 - real_all / self.computed, "passes_mean": statistics.mean(self.passes),
                "passes_max": max(self.passes), "peak_bytes": self.peak, "step_s_median": statistics.median(self.times)}


def plans(model: torch.nn.Module, rows: list[dict], first: list[dict]) -> tuple[dict[str, Plan], dict]:
    """The four variants' starting plans, and what the two probes cost."""
    lengths = [length_of(r) for r in rows]
    by_length = {}
    for r in rows:
        by_length.setdefault(length_of(r), r)

    def make_batch(b: int, length: int) -> dict[str, torch.Tensor]:
        return collate([by_length[length]] * b)

    started = time.perf_counter()
    tokens = autoaccum.probe(model=model, loss_fn=token_loss, make_batch=make_batch, target_batch=TARGET,
                             budget=BUDGET, headroom=HEADROOM, lengths=lengths, lengths_source="all samples")
    token_probe_s = time.perf_counter() - started
    at_longest = max(c.micro_batch for c in tokens.candidates if c.length == max(lengths) and c.status == "ok")
    first_batch = collate(first)
    started = time.perf_counter()
    firsts = autoaccum.probe(model=model, loss_fn=token_loss, target_batch=TARGET, budget=BUDGET, headroom=HEADROOM,
                             make_batch=lambda b: {k: v[:b] for k, v in first_batch.items()})
    first_probe_s = time.perf_counter() - started
    fixed = Plan.for_target(TARGET, at_longest)
    return ({"fixed-longest": fixed, "first-batch": firsts.plan, "grouped": fixed, "token-budget": tokens.plan},
            {"token_probe_s": token_probe_s, "token_probe_ooms": tokens.probe_ooms, "first_probe_s": first_probe_s,
             "first_probe_ooms": firsts.probe_ooms, "limit_at_longest": at_longest,
             "first_batch_longest": int(first_batch["attention_mask"].sum(1).max()),
             "token_model": tokens.token_model.to_dict() if tokens.token_model else None})


def run(args: object = None) -> dict:
    torch.manual_seed(0)
    rows = make_rows(TARGET * STEPS, seed=1)
    lengths = sorted(length_of(r) for r in rows)
    model = TinyGPT(vocab_size=VOCAB, seq_len=LONGEST, dim=64, layers=2, heads=4)
    batches, order_seed = global_batches(rows)
    starting, probes = plans(model, rows, batches[0])
    variants = [Variant(name, model, starting[name], by_tokens=name in ("grouped", "token-budget"))
                for name in VARIANTS]
    for index, items in enumerate(batches):
        for v in variants:
            v.step(items, index)
    result = {v.name: v.summary(batches) for v in variants}
    base = result["fixed-longest"]["tokens_per_s"]
    for name in VARIANTS:
        result[name]["speed_vs_fixed"] = result[name]["tokens_per_s"] / base
    return {"benchmark": "variable_length", "variants": result, "probes": probes, "torch": torch.__version__,
            "data": {"sequences": len(rows), "median": lengths[len(lengths) // 2], "longest": lengths[-1],
                     "shortest": lengths[0], "steps": STEPS, "target": TARGET, "order_seed": order_seed},
            "budget": BUDGET, "headroom": HEADROOM}


def table(result: dict) -> str:
    rows = [("variant", "plan (start)", "tokens/s", "x (a)", "OOMs", "padding", "micro-steps", "final plan")]
    for label, name in zip("abcd", VARIANTS):
        r = result["variants"][name]
        rows.append((f"({label}) {name}", r["plan"], f"{r['tokens_per_s']:,.0f}", f"{r['speed_vs_fixed']:.2f}",
                     str(r["ooms"]), f"{r['padding']:.1%}", f"{r['passes_mean']:.1f} (max {r['passes_max']})",
                     r["final_plan"] if r["final_plan"] != r["plan"] else "unchanged"))
    v = result["variants"]
    tb = v["token-budget"]
    return markdown_table(rows) + (
        f"\n\nGoals: (d) {tb['ooms']} OOMs (0); {tb['speed_vs_fixed']:.2f}x the tokens/s of (a) (>= 1.5); padding "
        f"{tb['padding']:.1%} against (c)'s {v['grouped']['padding']:.1%} (less).")


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, table))
