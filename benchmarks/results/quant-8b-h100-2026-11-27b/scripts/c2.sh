#!/bin/bash
# call 2: CUDA tests of the quantized kernels (rows16 default, fp16 value factor), the kernel table, the bundled pair
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee $OUT/commit.txt
(cd benchmarks && timeout 110 python kernels.py --quant-only --breakdown --contexts 65536,131072 --out $OUT/kernels.json > $OUT/kernels.log 2>&1)
t kernels rc=$?; grep -v "Warn\|warn" $OUT/kernels.log | grep -v "^ *$"
timeout 190 python benchmarks/graph_engine.py --contexts 16384 --docs 2 --repeats 3 --new-tokens 256 \
    --only hf-static-ar,graph-ar,int4-self-g5,int4-self-full-g5 --gammas 5 --out $OUT/e2e > $OUT/e2e.log 2>&1
t e2e rc=$?; grep -v Warning $OUT/e2e.log | tail -14
timeout 100 python -m pytest tests/test_kernels.py -m cuda -q -x -p no:cacheprovider -k "quant or small_range or share_the_current or combine" > $OUT/cuda_kernels.log 2>&1
t kernels-tests rc=$?; tail -3 $OUT/cuda_kernels.log
timeout 180 python -m pytest tests/test_quant_gluon.py -m cuda -q -p no:cacheprovider --durations=5 > $OUT/cuda_gluon.log 2>&1
t gluon-tests rc=$?; tail -12 $OUT/cuda_gluon.log
