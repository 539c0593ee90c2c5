#!/usr/bin/env bash
# one call: env, pytest -m gpu, the CLI probe, then cold_probe new/old/new/old
export PYTHONUNBUFFERED=1
R=$PWD
LOG=$OUT/stderr.log
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch,sys,transformers;print(torch.__version__, transformers.__version__, sys.version)"; date -u; } > $OUT/env.txt 2>&1
PYTHONPATH=$R timeout 200 python3 -m pytest -q -m gpu -rs -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1
echo "pytest rc $?" >> $OUT/pytest_gpu.txt
PYTHONPATH=$R timeout 60 python3 -m autoaccum probe --device cuda --no-cache --json > $OUT/probe_cli.json 2>>$LOG
echo "probe cli rc $?" >> $OUT/env.txt
i=0
for v in new old new old; do
  i=$((i+1))
  if [ $v = new ]; then P=$R; else P=$R/.base; fi
  echo "cold $i $v $(date -u +%H:%M:%S)" >> $LOG
  PYTHONPATH=$P timeout 110 python3 benchmarks/cold_probe.py --repeats 2 --steps 6 --no-write --json-only > $OUT/cold_${i}_$v.json 2>>$LOG
  echo "cold $i $v rc $? $(date -u +%H:%M:%S)" >> $LOG
done
