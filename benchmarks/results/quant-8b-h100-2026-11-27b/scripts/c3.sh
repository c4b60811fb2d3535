#!/bin/bash
# call 3: 8B shape steps, batch 1, 32K/64K/128K (AR, int4 W4 draft, int4 verify), one engine sized 128K
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 560 python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 32768 65536 131072 --batches 1 \
  --only ar int4-w4-draft int4-verify --out $OUT/scale > $OUT/scale.log 2>&1
t scale rc=$?; grep -E "copy rate|^\[|^\| llama" $OUT/scale.log | tail -24
