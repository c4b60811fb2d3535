#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 60 python3 .devrun/batch_ab.py > $OUT/batch_ab.log 2>&1
echo "ab rc=$? $(( $(date +%s) - T0 ))s"; cat $OUT/batch_ab.log | grep -v Warn
timeout 500 python3 benchmarks/budgetdraft.py all --steps 650 --prompts 8 --drafter shipped-cumulative-views=hf_sparsekv/zoo/pair/drafter-budgetdraft --out runs/bd > $OUT/bd.log 2>&1
echo "bd rc=$? $(( $(date +%s) - T0 ))s"; tail -25 $OUT/bd.log
cp runs/bd/acceptance.json runs/bd/train.json $OUT/ 2>/dev/null
mkdir -p $OUT/bdd && cp runs/bd/budgetdraft/model.safetensors runs/bd/budgetdraft/config.json runs/bd/budgetdraft/training_summary.json $OUT/bdd/ 2>/dev/null
ls runs/bd runs/bd/budgetdraft | head -30
