#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python3 -m pytest tests -m "cuda and not slow" -q -p no:cacheprovider --durations=5 > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; grep -v "Warn\|warn" $OUT/tests.log | tail -15
timeout 240 python3 benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 32768 --batches 1 --only ar verify-6 verify-tree --out $OUT/tree8b > $OUT/tree8b.log 2>&1
echo "tree8b rc=$? $(( $(date +%s) - T0 ))s"; grep -v "Warn\|warn" $OUT/tree8b.log | grep "ms\|^|" | tail -20
