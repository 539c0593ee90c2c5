#!/usr/bin/env bash
# The GPU session (issue 16): one command for a lent GPU machine, from the repository root.
#
#   bash benchmarks/gpu_session.sh [--prev DIR] [--steps LIST] [--minutes N] [--dry-run] [--cpu]
#
# Steps, in order, each bounded by `timeout` (its own limit, and never past the session's deadline:
# --minutes, default 22; a step that would start with less than a minute left is skipped and says so):
#   env                   nvidia-smi, python, torch, transformers, optuna and the peers' versions
#   pytest_gpu            python -m pytest -q -m gpu -rs                          (limit 240 s)
#   probe_cuda            python -m autoaccum probe --device cuda --no-cache --json  (120 s)
#   probe_cuda_estimate   the same with --budget 1GiB --target-batch 2048 --estimate (120 s)
#   recovery_<model>      benchmarks/guard_bench.py --parts recovery (issue 15: an OOM at the first and at
#                         the last micro-batch, in extra step-times), TinyGPT dim 512 x 6 layers
#                         (recovery_gpt512) and dim 128 x 2 (recovery_gpt128) (120 s each)
#   cold_probe            benchmarks/cold_probe.py --repeats 3 --steps 6 (issue 15: the 134M MLP's probe in fresh
#                         processes, what it adds to a cold start, where its time goes) (150 s)
#   real_gpu_<model>      benchmarks/real_gpu.py --models <model> --out $OUT/real_gpu, for gpt2,
#                         resnet50, vit_b16, mlp (540 s each; about 3-6 min each on an H100)
#   real_gpu_report       benchmarks/real_gpu.py --report-only: the table and JSON of every model so
#                         far, and the section "## Real GPU (issue 16)" written into $OUT/RESULTS.md
#                         (a copy of benchmarks/RESULTS.md; the checkout's own file is not touched)
#   compare_gpu           benchmarks/compare.py --device cuda --size gpu --no-write --out $OUT/compare
#                         (whatever time is left, at most 20 min)
# The four models (about 20 minutes) and compare --size gpu do not all fit in one session: both are
# resumable. A model's parts and a compare workload are saved as they finish; the next session, given
# the earlier output with --prev, copies those results in first and measures only what is missing:
#
#   bash benchmarks/gpu_session.sh                                          # first machine
#   bash benchmarks/gpu_session.sh --prev PREV_OUT --steps real_gpu,compare # the next: go on
#
# Under a runner that allows 10 minutes a command, split it the same way, each call going on from the
# results of the calls before (PREV: their $OUT, copied into the checkout, where untracked files travel):
#   bash benchmarks/gpu_session.sh --minutes 9 --steps env,pytest,probe
#   bash benchmarks/gpu_session.sh --minutes 9 --steps real_gpu --prev PREV   # again until every model is done
#   bash benchmarks/gpu_session.sh --minutes 9 --steps compare --prev PREV    # again until every workload is done
#
# With 15 minutes of device time a session (as lent in 2026-11), one call of under 10 minutes is about all a
# session gets: the 2026-11-26 session ran the checks (`--minutes 5 --steps env,pytest,recovery,probe`, about
# 2 minutes) and then `benchmarks/real_gpu.py --models mlp gpt2` (5.3 minutes) in one call. Pack the files under
# $OUT into one archive before the call ends: the runner brings back at most 8 files.
#
# Output: everything under $OUT (default ./gpu_out; the GPU runner sets it): per step NAME.out (stdout:
# tables, JSON) and NAME.err (stderr: logs), steps.tsv (step, exit code, seconds: 124 = timed out),
# real_gpu/<model>.json, compare/<model>.json, RESULTS.md. Exit code 0 when every step ran and passed.
#
#   --prev DIR   results of an earlier session ($OUT there) to go on from
#   --steps LIST only the steps whose names start with one of these comma-separated prefixes
#                (e.g. real_gpu,compare: the checks of the first session are not repeated)
#   --minutes N  the session's deadline (default 22: the machine is held for 30 minutes)
#   --dry-run    print the steps and their commands; run nothing
#   --cpu        the same steps at CPU sizes (pytest's gpu tests skip; emulated budgets): checks this
#                script and the harness on a machine without a GPU, in a few minutes
#
# Issue 40's real-model rows (ResNet-50, ViT-B/16, GPT-2 355M, a 1.1B decoder with LoRA) have their own call,
# benchmarks/gpu_rows40.sh, packed for a runner that brings back at most 8 files.
#
# The package need not be installed: PYTHONPATH is set to the checkout. The search part of
# real_gpu.py needs optuna (skipped with its reason without it); compare's peers need accelerate,
# lightning and transformers (a missing one is reported as not installed).
set -u

OUT=${OUT:-./gpu_out}
PREV=""
STEPS=""
MINUTES=22
DRY=0
CPU=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prev) PREV=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --minutes) MINUTES=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --cpu) CPU=1; shift ;;
    *) echo "gpu_session.sh: unknown argument $1 (see the top of the script)" >&2; exit 2 ;;
  esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=$(command -v python3 || command -v python || echo python3)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
DEADLINE=$((MINUTES * 60))
FAILED=0

if [ "$CPU" = 1 ]; then
  DEVICE=cpu; SIZE=(--size cpu --device cpu --fit-steps 5); PROBE=(--device cpu); BUDGET=(--budget 64MiB)
  COMPARE=(--device cpu --size tiny --models mlp --systems autoaccum hand --steps 4 --no-runtime-oom)
else
  DEVICE=cuda; SIZE=(--size gpu --device cuda:0); PROBE=(--device cuda); BUDGET=()
  COMPARE=(--device cuda --size gpu)
fi

[ "$DRY" = 0 ] && mkdir -p "$OUT"
if [ -n "$PREV" ] && [ "$DRY" = 0 ]; then
  for sub in real_gpu compare; do
    if [ -d "$PREV/$sub" ]; then
      mkdir -p "$OUT/$sub"
      cp -n "$PREV/$sub"/*.json "$OUT/$sub"/ 2>/dev/null
    fi
  done
fi
[ "$DRY" = 0 ] && printf 'step\texit\tseconds\n' > "$OUT/steps.tsv"

# step NAME LIMIT_S COMMAND...: run COMMAND under timeout (its limit or what is left of the deadline)
step() {
  local name=$1 limit=$2 prefix wanted=0
  shift 2
  for prefix in ${STEPS//,/ }; do
    [[ $name == "$prefix"* ]] && wanted=1
  done
  if [ -n "$STEPS" ] && [ "$wanted" = 0 ]; then
    echo "not run: $name (not in --steps $STEPS)"
    return 0
  fi
  local left=$((DEADLINE - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  local shown="$*"
  echo "step $name (limit $limit s): timeout --kill-after=20 $limit ${shown//$'\n'/ }"
  [ "$DRY" = 1 ] && return 0
  if [ "$limit" -lt 60 ]; then
    echo "  skipped: less than a minute left of the ${MINUTES}-minute deadline"
    printf '%s\tskipped\t0\n' "$name" >> "$OUT/steps.tsv"
    FAILED=1
    return 0
  fi
  local started=$SECONDS rc
  timeout --kill-after=20 "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" >> "$OUT/steps.tsv"
  echo "  exit $rc after $((SECONDS - started)) s$([ "$rc" = 124 ] && echo ' (timed out)')"
  [ "$rc" = 0 ] || FAILED=1
}

ENV_REPORT='nvidia-smi || true
"$0" -c "import sys, platform; print(sys.version); print(platform.platform())"
for m in torch autoaccum transformers optuna accelerate lightning psutil pynvml; do
  "$0" -c "import importlib; m = importlib.import_module(\"$m\"); print(\"$m\", getattr(m, \"__version__\", \"\"))" \
    2>/dev/null || echo "$m: not importable"
done
"$0" -c "import torch; print(\"cuda\", torch.cuda.is_available(), torch.version.cuda,
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"\")"'

step env 90 bash -c "$ENV_REPORT" "$PY"
step pytest_gpu 240 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider
step probe_cuda 120 "$PY" -m autoaccum probe "${PROBE[@]}" ${BUDGET[@]+"${BUDGET[@]}"} --no-cache --json
step probe_cuda_estimate 120 "$PY" -m autoaccum probe "${PROBE[@]}" --budget 1GiB --target-batch 2048 --estimate \
  --no-cache --json
step recovery_gpt512 120 "$PY" benchmarks/guard_bench.py --device "$DEVICE" --parts recovery --repeats 21 \
  --dim 512 --layers 6 --heads 8 --seq-len 256 --target 64 --micro 16
step recovery_gpt128 120 "$PY" benchmarks/guard_bench.py --device "$DEVICE" --parts recovery --repeats 21
step cold_probe 150 "$PY" benchmarks/cold_probe.py --device "$([ "$DEVICE" = cuda ] && echo cuda:0 || echo cpu)" \
  --repeats 3 --steps 6 --no-write
for model in gpt2 resnet50 vit_b16 mlp; do
  step "real_gpu_$model" 540 "$PY" benchmarks/real_gpu.py "${SIZE[@]}" --models "$model" --out "$OUT/real_gpu" \
    --no-write
done
[ "$DRY" = 0 ] && cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
step real_gpu_report 120 "$PY" benchmarks/real_gpu.py "${SIZE[@]}" --report-only --out "$OUT/real_gpu" \
  --results "$OUT/RESULTS.md"
step compare_gpu 1200 "$PY" benchmarks/compare.py "${COMPARE[@]}" --no-write --out "$OUT/compare"

echo "session on $DEVICE done in $SECONDS s; steps in $OUT/steps.tsv"
exit $FAILED
