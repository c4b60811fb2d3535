#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
timeout 300 python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 131072 --batches 1 \
  --only int4-verify --profile 131072 --profile-steps int4-verify --out $OUT/scale > $OUT/prof.log 2>&1
t prof rc=$?; grep -v "Warn\|warn" $OUT/prof.log | grep -iE "kernel|gemv|gemm|quant|split|combine|total|ms|^\[" | head -40
timeout 150 python -m pytest tests/test_kernels.py -m cuda -q -x -p no:cacheprovider -k "small_range or share_the_current or quant_rows or quant_vec" > $OUT/cuda_kernels.log 2>&1
t kernels-tests rc=$?; tail -3 $OUT/cuda_kernels.log
