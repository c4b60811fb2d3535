#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 150 python3 benchmarks/decode_kernel.py --batches 1 4 16 --queries 1 6 --contexts 8192 32768 131072 --out $OUT/dk > $OUT/dk.log 2>&1
echo "dk rc=$? $(( $(date +%s) - T0 ))s"; grep " us \|out of memory" $OUT/dk.log | tail -20
timeout 420 python3 benchmarks/budgetdraft.py all --steps 650 --prompts 8 --variants budgetdraft budgetdraft-cumulative --out runs/bd2 > $OUT/bd2.log 2>&1
echo "bd rc=$? $(( $(date +%s) - T0 ))s"; grep "^|\|trained\|probe" $OUT/bd2.log
cp runs/bd2/acceptance.json $OUT/acceptance2.json; cp runs/bd2/train.json $OUT/train2.json
