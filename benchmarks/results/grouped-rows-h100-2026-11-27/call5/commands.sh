#!/bin/bash
# session 10, call 5: bundled pair at 16K after the grouped GEMV takes 17-32 rows: the best chain and a tree of 16
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
cd benchmarks
timeout 300 python graph_engine.py --contexts 16384 --docs 1 --repeats 3 --new-tokens 256 --budgets 256 --gammas 5,7 \
  --only graph-ar,chunk-256-g7 --extra chunk-256-g5-t16 --out $OUT/bundled 2>&1 | grep "^|"
