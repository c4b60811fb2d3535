#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
timeout 100 python .devrun/s13/rows.py > $OUT/rows.log 2>&1; t rows rc=$?; grep -v Warn $OUT/rows.log
timeout 420 python -m pytest tests/test_quant_gluon.py -m cuda -q -p no:cacheprovider --durations=8 > $OUT/cuda_gluon.log 2>&1
t gluon-tests rc=$?; tail -14 $OUT/cuda_gluon.log
