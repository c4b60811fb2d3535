#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 290 python3 benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 8192 --batches 16 --only ar verify-6 verify-tree --out $OUT/tree16 > $OUT/tree16.log 2>&1
echo "tree16 rc=$? $(( $(date +%s) - T0 ))s"; grep "^|\|ms" $OUT/tree16.log | head -12
