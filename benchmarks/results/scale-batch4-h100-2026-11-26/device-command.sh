#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 280 python3 benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 32768 --batches 4 --only ar hf-static-ar graph-ar --repeats 1 --out $OUT/b4 > $OUT/b4.log 2>&1
echo "b4 rc=$? $(( $(date +%s) - T0 ))s"; grep "^\[\|^|" $OUT/b4.log | tail -14
timeout 300 python3 -m pytest tests -m "cuda and not slow" -q -x -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; grep -E "passed|failed|error|^\.|^F" $OUT/tests.log | tail -5
