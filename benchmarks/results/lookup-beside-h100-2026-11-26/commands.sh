#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 230 python3 -m pytest tests/test_cuda.py -k "lookup or grouped" -m cuda -rfE -p no:cacheprovider -q > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; tail -4 $OUT/tests.log
timeout 330 python3 benchmarks/graph_engine.py --contexts 16384 --docs 1 --repeats 3 --new-tokens 256 --budgets 256 --gammas 3 --only hf-static-ar,graph-ar,chunk-256-g3,window-g3,lookup-g3 --extra chunk-256-g3-lookup,window-g3-lookup --out $OUT/ge > $OUT/ge.log 2>&1
echo "ge rc=$? $(( $(date +%s) - T0 ))s"; grep "^|" $OUT/ge.log | head -12
