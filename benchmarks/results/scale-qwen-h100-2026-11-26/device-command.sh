#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 530 python3 benchmarks/scale.py --pairs qwen2.5-7b+0.5b --contexts 32768 131072 --batches 1 --only ar verify-6 draft-chunk-1024 draft-window-1024 hf-static-ar graph-ar --repeats 1 --out $OUT/qw > $OUT/qw.log 2>&1
echo "qwen rc=$? $(( $(date +%s) - T0 ))s"; grep "^\[\|^|" $OUT/qw.log | tail -30
