#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 500 python3 benchmarks/selection_cost.py --contexts 16384 65536 --out $OUT/sel > $OUT/sel.log 2>&1
echo "sel rc=$? $(( $(date +%s) - T0 ))s"; grep -v "Warn\|warn" $OUT/sel.log | tail -12
