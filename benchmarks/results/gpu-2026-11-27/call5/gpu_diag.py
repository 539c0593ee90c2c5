"""Scratch diagnostic (not committed): where fit's step time goes against the hand loop on CUDA.

Per row: rounds of hand / fit / fit variants at the issue40 plan (no squeeze: the plan is given), then a
profiled fit and hand run (syncs and GPU busy time), then fit under torch.cuda sync-debug warnings.
"""
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.getcwd())
import autoaccum  # noqa: E402
from benchmarks.realgpu.loops import LR, Stamped, hand_loop, rate  # noqa: E402
from benchmarks.realgpu.models import build, fresh_model, rows40  # noqa: E402

OUT = os.environ.get("OUT", "out")
DEV = torch.device(os.environ.get("DEV", "cuda:0"))
SIZE = os.environ.get("SIZE", "gpu")
CUDA = DEV.type == "cuda"
ROWS = {"resnet50_bf16": 64, "gpt2_355m_bf16": 3, "vit_b16_bf16": 43}
STEPS = int(os.environ.get("STEPS", "16"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
VARIANTS = {k: v for k, v in {"fit": {}, "fit_grow_off": {"grow": "off"}, "fit_check_off": {}}.items()
            if k in os.environ.get("VARIANTS", "fit,fit_grow_off,fit_check_off").split(",")}
PROFILE = os.environ.get("PROFILE", "resnet50_bf16,gpt2_355m_bf16,vit_b16_bf16").split(",")
STEPS_OF = {"gpt2_355m_bf16": int(os.environ.get("GPT_STEPS", STEPS_DEFAULT := os.environ.get("STEPS", "16")))}


def fit_run(built, micro, steps, **kw):
    w = built.workload
    stamped = Stamped()
    plan = autoaccum.Plan.for_target(w.target_batch, micro)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autoaccum.fit(fresh_model(built, DEV), built.data, w.target_batch, loss_fn=stamped, plan=plan, device=DEV,
                      max_steps=steps, epochs=None, by_length=False, lr=LR, precision=w.precision, progress=False,
                      verbose=False, **kw)
    if CUDA:
        torch.cuda.synchronize()
    n = len(stamped.calls)
    # the BatchNorm floor trial may add calls at the start: take each step's first call from the end
    calls = stamped.calls[n - steps * plan.accum_steps:]
    return calls[::plan.accum_steps]


def hand_run(built, micro, steps, seed=0):
    w = built.workload
    out = hand_loop(fresh_model(built, DEV), built.data, w.target_batch, micro, steps, w.precision, DEV, seed=seed)
    if CUDA:
        torch.cuda.synchronize()
    return out["starts"]


def one(name, built, micro, which, steps, seed):
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    if which == "hand":
        starts = hand_run(built, micro, steps, seed)
    else:
        import autoaccum.step.optim as optim
        real = optim._check_finite
        if which == "fit_check_off":  # no finite check: no read on the host before optimizer.step()
            optim._check_finite = lambda params, loss, max_grad_norm, sync: (True, None)
        try:
            starts = fit_run(built, micro, steps, **VARIANTS[which])
        finally:
            optim._check_finite = real
    return rate(starts, built.workload.target_batch)


def profiled(built, micro, which, steps):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        if which == "hand":
            hand_run(built, micro, steps)
        else:
            fit_run(built, micro, steps)
        wall = time.perf_counter() - t0
    ev = prof.key_averages()
    names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
             "cudaMemGetInfo", "aten::item", "aten::_local_scalar_dense", "aten::copy_", "aten::to")
    counts = {e.key: [e.count, round(e.cpu_time_total / 1e3, 2)] for e in ev if e.key in names}
    gpu = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    table = ev.table(sort_by="self_cpu_time_total", row_limit=30)
    return {"wall_ms": round(wall * 1e3, 1), "gpu_busy_ms": round(gpu, 1), "counts": counts}, table


def sync_trace(built, micro, steps):
    """fit under sync-debug warnings: where the host waits for the device (autoaccum frames)."""
    seen = {}
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f"{f.filename.split('autoaccum/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                 if "autoaccum" in f.filename or "benchmarks" in f.filename]
        key = " <- ".join(reversed(stack[-4:]))
        seen[key] = seen.get(key, 0) + 1

    warnings.showwarning = show
    if CUDA:
        torch.cuda.set_sync_debug_mode(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            w = built.workload
            plan = autoaccum.Plan.for_target(w.target_batch, micro)
            autoaccum.fit(fresh_model(built, DEV), built.data, w.target_batch, plan=plan, device=DEV, max_steps=steps,
                          epochs=None, by_length=False, lr=LR, precision=w.precision, progress=False, verbose=False)
    finally:
        if CUDA:
            torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    return seen


def main():
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if CUDA else "cpu", "steps": STEPS,
               "rounds": ROUNDS, "rows": {}}
    only = sys.argv[1:] or list(ROWS)
    for name in only:
        micro = ROWS[name]
        t0 = time.perf_counter()
        built = build(rows40(SIZE)[name], DEV)
        row = {"micro": micro, "rates": {k: [] for k in ["hand", *VARIANTS]}}
        hand_run(built, micro, 3)  # warm-up: cuDNN / cuBLAS choices
        order = ["hand", *VARIANTS]
        for r in range(ROUNDS):
            seq = order[r % len(order):] + order[:r % len(order)]
            for which in seq:
                row["rates"][which].append(one(name, built, micro, which, STEPS_OF.get(name, STEPS), r))
        hand = statistics.median(row["rates"]["hand"])
        row["ratio_to_hand"] = {k: round(statistics.median(v) / hand, 3) for k, v in row["rates"].items()}
        print(name, json.dumps(row), flush=True)
        for which in ("hand", "fit") if name in PROFILE else ():
            summary, table = profiled(built, micro, which, 6)
            row[f"profile_{which}"] = summary
            with open(f"{OUT}/prof_{name}_{which}.txt", "w") as f:
                f.write(json.dumps(summary) + "\n" + table)
            print(name, which, json.dumps(summary), flush=True)
        row["syncs"] = sync_trace(built, micro, 4) if name in PROFILE else None
        print(name, "syncs", json.dumps(row["syncs"], indent=1), flush=True)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        results["rows"][name] = row
        del built
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        with open(f"{OUT}/diag.json", "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
