#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 200 python3 -m pytest tests/test_kernels.py -q -x -p no:cacheprovider -k "decode or static or batched or rows or ring" > $OUT/ktests.log 2>&1
echo "ktests rc=$? $(( $(date +%s) - T0 ))s"; tail -3 $OUT/ktests.log
timeout 240 python3 benchmarks/decode_kernel.py --batches 1 4 --queries 1 6 --contexts 8192 16384 32768 65536 131072 --out $OUT/dk > $OUT/dk.log 2>&1
echo "dk rc=$? $(( $(date +%s) - T0 ))s"; grep " us " $OUT/dk.log | tail -20
