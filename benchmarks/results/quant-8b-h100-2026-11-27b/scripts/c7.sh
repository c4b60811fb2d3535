#!/bin/bash
# 8B shape: batch 4 steps at 32K/64K; then HF static AR vs our graph AR end to end, batch 1, 32K
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
timeout 380 python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 32768 65536 --batches 4 \
  --only ar int4-w4-draft int4-verify --out $OUT/b4 > $OUT/b4.log 2>&1
t b4 rc=$?; grep -E "^\[|^\| llama" $OUT/b4.log | tail -16
timeout 200 python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 32768 --batches 1 \
  --only hf-static-ar graph-ar --repeats 1 --out $OUT/hf > $OUT/hf.log 2>&1
t hf rc=$?; grep -E "^\[|^\| llama" $OUT/hf.log | tail -8
