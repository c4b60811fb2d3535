#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 230 python3 -m pytest tests/test_cuda.py -m cuda -k "draft_trees or lookup_beside" -q -rf -p no:cacheprovider --durations=5 > $OUT/tests-trees.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; grep -v "Warn\|warn" $OUT/tests-trees.log | grep -E "FAILED|passed|failed|Error" | head -12
timeout 290 python3 benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 32768 --batches 1 --only verify-6 verify-tree-16 verify-tree-32 --out $OUT/tree8b > $OUT/tree8b.log 2>&1
echo "tree8b rc=$? $(( $(date +%s) - T0 ))s"; grep -v "Warn\|warn" $OUT/tree8b.log | grep "failed\|ms" | tail -14
