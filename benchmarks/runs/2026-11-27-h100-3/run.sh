#!/usr/bin/env bash
# One call on a lent GPU (2026-11-27, third session): the final code's GPU tests (the new NCCL test of the
# overlapped buckets' direct call among them), the cold probe of the 134M MLP (issue 15's probe row) in
# two fresh-process runs, the CUDA recovery benchmark, and the CLI probe. Each step bounded; a step
# that would start past the deadline is skipped and says so. Everything lands in $OUT (at most 8 files).
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R
LOG=$OUT/stderr.log
S=$OUT/steps.txt
DEADLINE=${DEADLINE:-470}
run() {  # run NAME LIMIT OUTFILE CMD...
  local name=$1 limit=$2 out=$3; shift 3
  if [ $((SECONDS + limit)) -gt "$DEADLINE" ]; then echo "$name skipped at ${SECONDS}s (deadline ${DEADLINE}s)" >> $S; return; fi
  local t0=$SECONDS
  echo "== $name $(date -u +%H:%M:%S)" >> $LOG
  timeout --kill-after=10 "$limit" "$@" > "$out" 2>> $LOG
  echo "$name rc $? $((SECONDS - t0))s end $(date -u +%H:%M:%S)" >> $S
}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,sys,transformers;print(torch.__version__, torch.version.cuda, transformers.__version__, sys.version)"
  git -C $R log --oneline -1 2>/dev/null || true; } > $OUT/env.txt 2>&1
run pytest_gpu 150 $OUT/pytest_gpu.txt python3 -m pytest -q -m gpu -rs -p no:cacheprovider
run cold_1 150 $OUT/cold_1.json python3 benchmarks/cold_probe.py --repeats 3 --steps 6 --no-write --json-only
run recovery_gpt512 100 $OUT/recovery_gpt512.out python3 benchmarks/guard_bench.py --device cuda --parts recovery \
  --repeats 21 --dim 512 --layers 6 --heads 8 --seq-len 256 --target 64 --micro 16
run cold_2 110 $OUT/cold_2.json python3 benchmarks/cold_probe.py --repeats 2 --steps 6 --no-write --json-only
echo "done at ${SECONDS}s $(date -u +%H:%M:%S)" >> $S
