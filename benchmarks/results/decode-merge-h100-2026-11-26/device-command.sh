#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest tests -m "cuda and not slow" -q -x -p no:cacheprovider --durations=5 > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; tail -12 $OUT/tests.log
timeout 240 python3 benchmarks/decode_kernel.py --merge-baseline --batches 1 4 --queries 1 6 --contexts 8192 16384 32768 65536 131072 --out $OUT/dk > $OUT/dk.log 2>&1
echo "dk rc=$? $(( $(date +%s) - T0 ))s"; grep "us" $OUT/dk.log | tail -24
