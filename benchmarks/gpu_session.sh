#!/usr/bin/env bash
# One call on a lent GPU, from the repository root: the GPU tests, ddp_bench on NCCL in a world of one,
# then the real-model table (benchmarks/real_gpu.py) row by row.
#
#   bash benchmarks/gpu_session.sh [--prev DIR_OR_TGZ] [--steps LIST] [--seconds N] [--dry-run] [--cpu]
#
# Steps, in priority order, each under `timeout` (its limit, never past the --seconds deadline, default 320):
# env, pytest_gpu, ddp_gpu (the default MLP, and 68M parameters in one micro-batch), row_<name> (one process
# a row), report (the table and targets). A row's parts are saved as they finish, so a later call given this
# call's rows.tgz with --prev measures only what is missing. Output under $OUT (default ./gpu_out): env.txt,
# pytest_gpu.txt, ddp_gpu.txt, steps.tsv, log.txt, rows.tgz, report.txt. --cpu: the same steps at CPU sizes.
set -u

OUT=${OUT:-./gpu_out}
PREV=""
STEPS=""
SECONDS_LIMIT=320
DRY=0
CPU=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prev) PREV=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --seconds) SECONDS_LIMIT=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --cpu) CPU=1; shift ;;
    *) echo "gpu_session.sh: unknown argument $1 (see the top of the script)" >&2; exit 2 ;;
  esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=$(command -v python3 || command -v python || echo python3)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=$(mkdir -p "$OUT" 2>/dev/null; cd "$OUT" 2>/dev/null && pwd || echo "$OUT")
ROWS_DIR=$(mktemp -d 2>/dev/null || echo /tmp/real_gpu_rows)  # outside $OUT: only the packed rows.tgz comes back
FAILED=0
if [ "$CPU" = 1 ]; then
  SIZE=(--size cpu --device cpu)
else
  SIZE=(--size gpu --device cuda:0)
fi

if [ -n "$PREV" ] && [ "$DRY" = 0 ]; then
  if [ -f "$PREV" ]; then
    tar -xzf "$PREV" -C "$ROWS_DIR" || echo "gpu_session.sh: could not unpack $PREV" >&2
  elif [ -d "$PREV" ]; then
    cp "$PREV"/*.json "$ROWS_DIR"/ 2>/dev/null || echo "gpu_session.sh: no row files in $PREV" >&2
  else
    echo "gpu_session.sh: --prev $PREV is neither a file nor a folder" >&2
  fi
fi
[ "$DRY" = 0 ] && printf 'step\texit\tseconds\n' > "$OUT/steps.tsv"

pack() {
  [ "$DRY" = 1 ] && return 0
  (cd "$ROWS_DIR" && tar -czf "$OUT/rows.tgz.part" -- $(ls *.json 2>/dev/null) 2>/dev/null) \
    && mv "$OUT/rows.tgz.part" "$OUT/rows.tgz"
}

# step NAME LIMIT_S STDOUT COMMAND...: run COMMAND under timeout (its limit or what is left of the deadline)
step() {
  local name=$1 limit=$2 out=$3 prefix wanted=0
  shift 3
  for prefix in ${STEPS//,/ }; do
    [[ $name == "$prefix"* ]] && wanted=1
  done
  if [ -n "$STEPS" ] && [ "$wanted" = 0 ]; then
    echo "not run: $name (not in --steps $STEPS)"
    return 0
  fi
  local left=$((SECONDS_LIMIT - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  echo "step $name (limit $limit s): timeout --kill-after=5 $limit $*"
  [ "$DRY" = 1 ] && return 0
  if [ "$limit" -lt 20 ]; then
    echo "  skipped: less than 20 s left of the ${SECONDS_LIMIT}-second deadline"
    printf '%s\tskipped\t0\n' "$name" >> "$OUT/steps.tsv"
    FAILED=1
    return 0
  fi
  local started=$SECONDS rc
  echo "== $name $(date -u +%H:%M:%S)" >> "$OUT/log.txt"
  timeout --kill-after=5 "$limit" "$@" > "$out" 2>> "$OUT/log.txt"
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" >> "$OUT/steps.tsv"
  echo "  exit $rc after $((SECONDS - started)) s$([ "$rc" = 124 ] && echo ' (timed out)')"
  [ "$rc" = 0 ] || FAILED=1
  pack
}

ENV_REPORT='nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
"$0" -c "
import importlib, platform, sys
print(sys.version.split()[0], platform.platform())
for m in (\"torch\", \"autoaccum\", \"transformers\", \"peft\", \"accelerate\", \"psutil\", \"pynvml\"):
    try:
        print(m, getattr(importlib.import_module(m), \"__version__\", \"\"))
    except ImportError as exc:
        print(m, \"not importable:\", exc)
import torch
print(\"cuda\", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"\")
"'

step env 30 "$OUT/env.txt" bash -c "$ENV_REPORT" "$PY"
step pytest_gpu 150 "$OUT/pytest_gpu.txt" "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider
if [ "$CPU" = 1 ]; then
  DDP=(--world-size 2 --interleaved 10)
else
  DDP=(--backend nccl --device cuda --world-size 1 --interleaved 100)
fi
step ddp_gpu 110 "$OUT/ddp_gpu.txt" bash -c '"$0" benchmarks/ddp_bench.py "$@" && "$0" benchmarks/ddp_bench.py "$@" \
  --hidden 8192 --accum 1 --micro 256' "$PY" "${DDP[@]}"
for row in gpt2_355m_bf16:75 llama_1b_lora_bf16:90 vit_b16_bf16:55 resnet50_bf16:55 vit_b16_fp32:55 \
           resnet50_fp32:55; do
  step "row_${row%%:*}" "${row##*:}" /dev/null "$PY" benchmarks/real_gpu.py "${SIZE[@]}" \
    --models "${row%%:*}" --out "$ROWS_DIR" --json-only
done
step report 30 "$OUT/report.txt" "$PY" benchmarks/real_gpu.py "${SIZE[@]}" --report-only \
  --out "$ROWS_DIR"

echo "done in $SECONDS s; steps in $OUT/steps.tsv"
exit $FAILED
