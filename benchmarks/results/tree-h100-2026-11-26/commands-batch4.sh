#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 250 python3 benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 32768 --batches 4 16 --only ar verify-6 verify-tree --out $OUT/treebatch > $OUT/treebatch.log 2>&1
echo "treebatch rc=$? $(( $(date +%s) - T0 ))s"; grep "^|" $OUT/treebatch.log | head -12
timeout 300 python3 benchmarks/decode_kernel.py --sweep --sweep-batch 8 --sweep-contexts 8192 32768 --batches 8 --queries 1 --contexts 8192 32768 --out $OUT/sw8 > $OUT/sw8.log 2>&1
echo "sweep8 rc=$? $(( $(date +%s) - T0 ))s"; grep "winner" $OUT/sw8.log; grep " us \|^|" $OUT/sw8.log | tail -14
