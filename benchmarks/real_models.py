"""Real models: the probe, the guard and exactness on Hugging Face GPT-2, BERT and ResNet, on a CPU.

Small Transformers configs, dict batches with ``labels`` and the model's own loss, fp32 and bf16
autocast, each under an emulated budget where the target needs accumulation: the probe's plan, limit,
OOMs and time; 20 steps of ``fit(plan=report)`` under the same budget and their OOMs; brute force (the
largest micro-batch whose two accumulated passes and AdamW step run under ``budget * (1 - headroom)``);
and in float64, 3 accumulated steps against 3 full-batch steps (``max |p - ref| / max |ref|``). Needs
transformers (``pip install 'autoaccum[bench]'``).

    python benchmarks/real_models.py [--json-only] [--threads N]
"""

from __future__ import annotations

import logging
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import probe_bench
import torch
from common import bench_main, markdown_table
from torch import nn

import autoaccum
from autoaccum import parse_bytes
from autoaccum.step.losses import default_loss

try:
    import transformers
except ImportError:  # the benchmark's only dependency beyond autoaccum
    sys.exit("benchmarks/real_models.py needs transformers: pip install 'autoaccum[bench]'")

HEADROOM = 0.1
FIT_STEPS = 20
EXACT_STEPS = 3
DROPOUT = 0.1  # Transformers' default for GPT-2 and BERT; 0 in the exactness runs
VOCAB, SEQ, PAD = 256, 64, 0
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Workload:
    """A model, its data and the budget it is measured under.

    Attributes:
        make_model: ``make_model(dropout)`` -> a fresh model, the same initial weights every call.
        make_data: ``make_data(samples, seed)`` -> a dict batch of that many samples.
        target: the global batch; budget: the emulated device's memory.
        smallest: the smallest micro-batch the model trains at (2 for ResNet on 32 x 32 images: its
            last stage's BatchNorm sees 1 x 1 maps, and torch refuses one value per channel).
    """

    name: str
    make_model: Callable[[float], nn.Module]
    make_data: Callable[[int, int], dict[str, torch.Tensor]]
    target: int
    budget: str
    smallest: int = 1


def _gpt2(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(config)


def _bert(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, max_position_embeddings=SEQ, num_labels=3,
                                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                     pad_token_id=PAD)
    return transformers.BertForSequenceClassification(config)


def _resnet(dropout: float) -> nn.Module:  # no dropout in ResNet
    torch.manual_seed(0)
    config = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                                       depths=[1, 1, 1, 1], num_labels=10)
    return transformers.ResNetForImageClassification(config)


def _tokens(num: int, seed: int, per_sample_labels: bool = False) -> dict[str, torch.Tensor]:
    """``num`` rows of SEQ/4..SEQ tokens, right-padded to SEQ (a tokenizer's ``padding="max_length"``);
    labels: the tokens, -100 on padding (causal LM), or one class per row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(SEQ // 4, SEQ + 1, (num,), generator=g)
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    ids = torch.randint(3, VOCAB, (num, SEQ), generator=g).masked_fill(mask == 0, PAD)
    labels = torch.randint(0, 3, (num,), generator=g) if per_sample_labels else ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _images(num: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(num, 3, 32, 32, generator=g)
    return {"pixel_values": pixels, "labels": torch.randint(0, 10, (num,), generator=g)}


WORKLOADS = (
    Workload("gpt2 (causal LM)", _gpt2, _tokens, target=64, budget="16MiB"),
    Workload("bert (classification)", _bert, lambda n, s: _tokens(n, s, per_sample_labels=True), target=64,
             budget="12MiB"),
    Workload("resnet (batchnorm)", _resnet, _images, target=128, budget="3MiB", smallest=2),
)


def _model_loss(precision: str) -> Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]:
    """The model's own loss, its forward under the precision's autocast (as the guard runs it)."""
    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            return model(**batch).loss
    return loss_fn


def brute_force(w: Workload, precision: str, usable_bytes: int) -> tuple[int, int]:
    """(the largest micro-batch that runs under ``usable_bytes``, runs spent): probe_bench's brute force
    (two accumulation steps of a fresh model, each two forward/backward passes and AdamW), from the
    smallest size the model trains at, under the precision's autocast."""
    shape = probe_bench.Shape(w.name, lambda: w.make_model(DROPOUT), lambda b: w.make_data(b, b),
                              _model_loss(precision), budgets=())
    return probe_bench.brute_force(shape, usable_bytes, smallest=w.smallest)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``max |a - b| / max |b|`` over all parameters together (per tensor it means nothing for attention
    key biases, whose gradient is zero in exact arithmetic: both sides hold rounding noise)."""
    return max(float((a[n] - b[n]).abs().max()) for n in a) / max(float(b[n].abs().max()) for n in b)


def exactness(w: Workload, plan: autoaccum.Plan) -> tuple[float, float]:
    """fp64: EXACT_STEPS steps of ``fit`` at ``plan`` against full-batch steps on the same samples (SGD).
    Returns (the difference, the reference's own change from the initial weights, on the same scale)."""
    def double(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}

    batches = [double(w.make_data(w.target, 100 + s)) for s in range(EXACT_STEPS)]
    reference = w.make_model(0.0).double()
    initial = _params(reference)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in batches:  # one forward of each whole global batch, the model's own loss
        optimizer.zero_grad()
        reference(**batch).loss.backward()
        optimizer.step()
    model = w.make_model(0.0).double()
    autoaccum.fit(model, iter(batches), w.target, plan=plan, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  progress=False, verbose=False)
    return rel_diff(_params(model), _params(reference)), rel_diff(initial, _params(reference))


class _Changes(logging.Handler):
    """The guard's plan changes (one log record each), kept even when fit raises."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def train(w: Workload, precision: str, data: object, report: autoaccum.ProbeReport) -> dict:
    """FIT_STEPS steps of ``fit`` on the probe's plan under the same emulated budget: the OOMs they raised,
    and the error that ended them early, if one did."""
    changes, guard_logger = _Changes(), logging.getLogger("autoaccum.guard")
    guard_logger.addHandler(changes)
    started, error, result = time.perf_counter(), None, None
    try:
        result = autoaccum.fit(w.make_model(DROPOUT), data, w.target, plan=report, budget=report.budget_bytes,
                               headroom=HEADROOM, precision=precision, max_steps=FIT_STEPS, epochs=None,
                               progress=False, verbose=False)
    except (torch.OutOfMemoryError, autoaccum.AutoAccumError) as exc:  # an OOM the guard did not replay
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        guard_logger.removeHandler(changes)
    return {"steps": None if result is None else result.optimizer_steps,
            "ooms": sum(" OOM " in f" {m} " for m in changes.messages), "plan_changes": changes.messages,
            "peak_bytes": None if result is None else result.peak_bytes, "error": error,
            "wall_time_s": time.perf_counter() - started}


def run_row(w: Workload, precision: str) -> dict:
    """One model at one precision: the probe, FIT_STEPS steps of fit on its plan, brute force, fp64 exactness."""
    budget_bytes = parse_bytes(w.budget)
    usable = int(budget_bytes * (1 - HEADROOM))
    data = w.make_data(4 * w.target, 1)
    model = w.make_model(DROPOUT)
    def first(b: int) -> dict[str, torch.Tensor]:  # fresh tensors, as fit gathers them: the probe counts them
        return {k: v[:b].clone() for k, v in data.items()}

    # what fit(..., budget=...) runs first; apart, so that its report survives a crash in training
    report = autoaccum.probe(model=model, loss_fn=default_loss, make_batch=first, target_batch=w.target,
                             budget=budget_bytes, headroom=HEADROOM, precision=precision)
    trained = train(w, precision, data, report)
    brute, brute_runs = brute_force(w, precision, usable)
    diff, update = exactness(w, report.plan)
    return {
        "model": w.name, "precision": precision, "budget": w.budget, "budget_bytes": budget_bytes,
        "usable_bytes": usable, "target": w.target, "params": sum(p.numel() for p in model.parameters()),
        "probe": {"wall_time_s": report.wall_time_s, "passes": report.probe_steps, "ooms": report.probe_ooms,
                  "candidates": [[c.micro_batch, c.status] for c in report.candidates],
                  "max_fitting": report.max_fitting_micro_batch, "plan": report.plan.to_dict(),
                  "fit_note": report.fit_note},
        "brute_force": {"largest": brute, "runs": brute_runs},
        "fit": trained,
        "fp64_rel_diff": diff, "fp64_update_rel": update,
    }


def run() -> dict:
    transformers.logging.set_verbosity_error()  # HF's note that the config names no loss_type
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the BatchNorm warning: the table's exactness column shows it
        for w in WORKLOADS:
            for precision in PRECISIONS:
                rows.append(run_row(w, precision))
    return {"version": 1, "kind": "autoaccum.bench.real_models", "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.is_available(), "device": "cpu (tracked meter, emulated budget)",
            "headroom": HEADROOM, "fit_steps": FIT_STEPS, "exact_steps": EXACT_STEPS, "rows": rows}


HEAD = ("model", "precision", "budget", "target", "plan", "probe s", "passes", "probe OOMs", "found", "brute force",
        "found/brute", "fit OOMs", "fit peak / usable", "fp64 rel. diff")


def _cells(r: dict) -> tuple[str, ...]:
    """One row of the table (HEAD's columns)."""
    p, b, f = r["probe"], r["brute_force"]["largest"], r["fit"]
    trained = f"{f['ooms']} in {f['steps']}" if f["error"] is None else f"{f['ooms']}, then crashed"
    peak = "-" if f["peak_bytes"] is None else f"{f['peak_bytes'] / r['usable_bytes']:.1%}"
    return (r["model"], r["precision"], r["budget"], str(r["target"]),
            f"{p['plan']['micro_batch']} x {p['plan']['accum_steps']}", f"{p['wall_time_s']:.2f}", str(p["passes"]),
            str(p["ooms"]), str(p["max_fitting"]), str(b), f"{p['max_fitting'] / b:.1%}" if b else "-", trained, peak,
            f"{r['fp64_rel_diff']:.1e}")


def table(result: dict) -> str:
    return markdown_table([HEAD, *(_cells(r) for r in result["rows"])])


def main() -> int:
    return bench_main(__doc__, run, table)


if __name__ == "__main__":
    sys.exit(main())
