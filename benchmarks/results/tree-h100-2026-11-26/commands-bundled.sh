#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 560 python3 benchmarks/graph_engine.py --contexts 16384 --docs 1 --repeats 3 --new-tokens 256 --budgets 256 --gammas 3 --only hf-static-ar,graph-ar,chunk-256-g3,window-g3,lookup-g3 --extra chunk-256-g3-lookup,window-g3-lookup --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s) - T0 ))s"; grep -v "Warn\|warn" $OUT/e2e.log | grep "^|\|tok" | tail -20
