#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 120 python3 -m pytest tests/test_kernels.py -q -x -p no:cacheprovider -k "decode or batched or rows or ring" > $OUT/ktests.log 2>&1
echo "ktests rc=$? $(( $(date +%s) - T0 ))s"; tail -2 $OUT/ktests.log
timeout 200 python3 benchmarks/decode_kernel.py --batches 1 2 4 8 16 64 --queries 1 6 --contexts 8192 32768 --out $OUT/dk > $OUT/dk.log 2>&1
echo "dk rc=$? $(( $(date +%s) - T0 ))s"; grep " us \|memory" $OUT/dk.log
timeout 100 python3 benchmarks/decode_kernel.py --batches 1 4 16 --queries 1 6 --contexts 131072 --out $OUT/dk128 > $OUT/dk128.log 2>&1
echo "dk128 rc=$? $(( $(date +%s) - T0 ))s"; grep " us \|memory" $OUT/dk128.log
