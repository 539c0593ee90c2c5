#!/usr/bin/env bash
export PYTHONUNBUFFERED=1
R=$PWD
date -u > $OUT/env.txt
PYTHONPATH=$R timeout 100 python3 -m pytest -q -m gpu -rs -p no:cacheprovider -x > $OUT/pytest_gpu.txt 2>&1
echo "pytest rc $?" >> $OUT/pytest_gpu.txt
PYTHONPATH=$R timeout 60 python3 benchmarks/cold_probe.py --repeats 1 --steps 6 --no-write --json-only > $OUT/cold_6_new.json 2>$OUT/stderr.log
echo "cold rc $? $(date -u +%H:%M:%S)" >> $OUT/env.txt
