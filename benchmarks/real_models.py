"""Real models (issue 11): the probe, the guard and exactness on Hugging Face GPT-2, BERT and ResNet.

Each model is built from a small Transformers config (a few MiB of activations per micro-batch) and
trained on synthetic data held as a Hugging Face user holds it (a dict of padded tensors with
``labels``; fit's default loss is the model's own). For each model, in fp32 and in bf16 (autocast
on the CPU), under an emulated budget chosen per model so that the target batch needs accumulation:

- **probe**: ``autoaccum.probe`` (what ``fit(..., budget=...)`` runs first): the plan, the largest
  size it found to fit (``report.max_fitting_micro_batch``), its OOMs, passes and wall time;
- **training**: 20 steps of ``autoaccum.fit(..., plan=report)`` under the same budget: the OOMs
  they raised (goal 0), and the error that ended them, if one did; and, as a control, the same
  steps on global batches made before fit starts (so that no global batch counts);
- **brute force**: the largest micro-batch whose two accumulated forward/backward passes and the
  AdamW step run on a fresh model under ``budget * (1 - headroom)`` (two such steps: the
  optimizer's state exists from the first), under the same autocast, found by real runs (doubling
  from the smallest size the model trains at, then bisection; checked at ``b`` and ``b + 1``);
- **exactness** in float64 (the fp32 path): 3 accumulated steps at the plan's micro-batch against 3
  full-batch steps on the same samples (SGD, dropout off), ``max |p - ref| / max |ref|`` over all
  parameters together.

Prints a table, then one JSON document, and writes the section "## Real models (issue 11)" of
benchmarks/RESULTS.md (``--no-write`` to skip; other sections stay as they are). Needs
transformers (``pip install 'autoaccum[bench]'``). Not part of the test run. A few minutes on a CPU:

    python benchmarks/real_models.py [--json-only] [--no-write] [--threads N]
"""

from __future__ import annotations

import logging
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import autoaccum
import probe_bench
from autoaccum import parse_bytes
from autoaccum.step.losses import default_loss
from results_md import RESULTS, bench_main, markdown_table, replace_section

try:
    import transformers
except ImportError:  # the benchmark's only dependency beyond autoaccum
    sys.exit("benchmarks/real_models.py needs transformers: pip install 'autoaccum[bench]'")

SECTION = "## Real models (issue 11)"
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
    changes, guard_logger = _Changes(), logging.getLogger("autoaccum.step.guard")
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
    # The control: the same steps on global batches made before fit starts, so that, as on a device whose
    # data stays on the host, no global batch counts against the budget (nor, here, do the micro-batch
    # inputs, which are views of them: a lower bound on memory).
    made = [{k: v[i * w.target:(i + 1) * w.target].clone() for k, v in data.items()} for i in range(4)]
    control = train(w, precision, iter(made * (FIT_STEPS // len(made))), report)
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
        "fit": trained, "fit_batches_made_outside": control,
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


def _label(r: dict) -> str:
    return f"{r['model']} {r['precision']}"


def _overshot(r: dict) -> bool:
    """The probe's first two sizes fitted and the third, more than twice the second, did not."""
    (first, s1), (second, s2), (third, s3) = (r["probe"]["candidates"] + [[0, "none"]] * 3)[:3]
    return s1 == s2 == "ok" and s3 in ("oom", "over_budget") and third > 2 * second


def _probe_findings(rows: list[dict]) -> list[str]:
    short = [f"{_label(r)} ({r['probe']['max_fitting']} of {r['brute_force']['largest']})"
             for r in rows if r["probe"]["max_fitting"] != r["brute_force"]["largest"]]
    ooms = [f"{_label(r)}: {r['probe']['ooms']}" for r in rows if r["probe"]["ooms"]]
    lines = ["- Found limit vs brute force: "
             + ("equal on every row." if not short else f"equal except {', '.join(short)}."),
             "- Probe OOMs: " + ("none." if not ooms else f"{', '.join(ooms)}.")]
    if any(_overshot(r) for r in rows):
        lines.append(
            "  Where the probe's third size was more than twice its second and did not fit (the sizes below): its "
            "first two sizes lay on one line whose limit was the larger of them, and `autoaccum/probe.py` "
            "`_next_size` then bisects between that size and the target (its 'fit verified' exit needs three "
            "points), so it overshot and bisected back through OOMs where measuring one size more would have "
            "bracketed the limit.")
    return lines


def _training_findings(rows: list[dict], steps: int) -> list[str]:
    ooms = [f"{_label(r)}: {'; '.join(r['fit']['plan_changes'])}" for r in rows if r["fit"]["ooms"]]
    crashed = [r for r in rows if r["fit"]["error"]]
    lines = [f"- Training OOMs (goal 0 in {steps} steps on the probe's plan): "
             + ("none." if not ooms else f"**{len(ooms)} row(s) raised some**: {' · '.join(ooms)}."),
             "- Training runs that ended in an error: " + ("none." if not crashed else "**" + " · ".join(
                 f"{_label(r)}: `{r['fit']['error']}`" for r in crashed) + "**.")]
    if any("aten.index" in r["fit"]["error"] for r in crashed):
        lines.append(
            "  `aten.index` is fit gathering the next global batch, outside the guard. Under an emulated budget fit "
            "draws each global batch inside the counted region, so all of its inputs count against the budget during "
            "every micro-step (and the previous one is still referenced while the next is gathered); the probe counts "
            "one micro-batch's inputs, as a device whose data stays on the host holds them.")
    control = ", ".join(f"{_label(r)}: {r['fit_batches_made_outside']['ooms']} OOMs in "
                        f"{r['fit_batches_made_outside']['steps']} steps" for r in crashed or rows)
    lines.append(f"- Control, the same plan on global batches made before fit starts (no global batch counted): "
                 f"{control}.")
    return lines


def _findings(result: dict) -> list[str]:
    """The goals, met or not, read off the rows (so that the section says what this run found)."""
    rows = result["rows"]
    worst = max(r["fp64_rel_diff"] for r in rows if "batchnorm" not in r["model"])
    return [
        *_training_findings(rows, result["fit_steps"]), *_probe_findings(rows),
        f"- fp64 exactness without BatchNorm (GPT-2, BERT): worst {worst:.1e} (the promise: ~1e-12; GPT-2's loss "
        f"computes its cross-entropy in float32 even for a float64 model, on both sides). ResNet: "
        + ", ".join(f"{r['fp64_rel_diff']:.1e}" for r in rows if "batchnorm" in r["model"])
        + " -- not exact by design: each micro-batch is normalised with its own BatchNorm statistics (the guard "
          "warns; the remedies are GroupNorm/LayerNorm, SyncBatchNorm or ghost batch norm).",
    ]


def write_section(result: dict, command: str, path: Path = RESULTS) -> None:
    """Replace (or add) this benchmark's section of RESULTS.md; other sections stay as they are."""
    sizes = "; ".join(f"{r['model']} {r['precision']}: "
                      + " -> ".join(f"{b}" + ("" if s == "ok" else f" ({s})") for b, s in r["probe"]["candidates"])
                      for r in result["rows"])
    section = "\n".join([
        SECTION, "",
        f"Command: `{command}` · {result['date']} · {result['machine']} · torch {result['torch']}, transformers "
        f"{result['transformers']}, python {result['python']}, {result['threads']} intra-op thread(s) · total wall "
        f"time {result['total_wall_time_s']:.0f} s", "",
        "Hugging Face models from small configs (GPT-2 `GPT2LMHeadModel` 2 x 64, 64 tokens; BERT "
        "`BertForSequenceClassification` 2 x 64, 64 tokens; `ResNetForImageClassification` 16-128 channels on 32 x 32 "
        "images), dict batches of padded tensors with `labels`, the model's own loss (fit's default), AdamW, dropout "
        f"0.1 where the model has it. CPU, tracked meter, emulated budget per model, headroom "
        f"{result['headroom']:.0%}; bf16 = `torch.autocast('cpu', dtype=torch.bfloat16)` (weights and AdamW state "
        "in fp32).", "",
        table(result), "",
        "Columns: *plan* = the probe's micro-batch x accumulation steps; *probe s / passes / probe OOMs* = its wall "
        "time, forward/backward passes (an OOM counts as one) and the OOMs it triggered; *found* = "
        "`report.max_fitting_micro_batch`; *brute force* = the largest micro-batch whose two accumulated "
        "forward/backward passes and AdamW step run on a fresh model under `budget x (1 - headroom)`, two such steps, "
        "under the same autocast (doubling from the smallest size the model trains at, then bisection; checked at b "
        f"and b + 1); *fit OOMs* = OOMs raised in {result['fit_steps']} steps of `fit(model, data, plan=report, "
        "budget=...)` (data: one dict of tensors, from which fit gathers each global batch) on the probe's plan (the "
        "guard replays such a step smaller); *fit peak / usable* = the largest step peak over the usable "
        f"budget; *fp64 rel. diff* = in float64 (fp32 path, dropout 0, SGD lr 0.1), {result['exact_steps']} steps of "
        "`fit` at the row's plan against as many full-batch steps on the same samples, max |p - ref| / max |ref| over "
        "all parameters (the reference's own change from its initial weights, on the same scale: "
        + ", ".join(f"{r['fp64_update_rel']:.1e}" for r in result["rows"][::len(PRECISIONS)]) + ").", "",
        "What this run found:", *_findings(result), "",
        f"Sizes the probe measured, in order: {sizes}.", "",
    ])
    replace_section(SECTION, section, path)


def main() -> int:
    return bench_main(__doc__, "real_models.py", run, table, write_section)


if __name__ == "__main__":
    sys.exit(main())
