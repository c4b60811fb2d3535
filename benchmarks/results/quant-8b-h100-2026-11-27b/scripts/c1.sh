#!/bin/bash
# call 1: new CUDA tests, occupancy/rows sweep, merge_buffer off/on at the kernel
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
date
(timeout 150 python -m pytest tests/test_kernels.py -q -x -k "merge_buffer or share_the_current or combine_merges" 2>&1 | tail -3; timeout 150 python -m pytest tests/test_quant_gluon.py -q -x -k "sixteen or launch_settings or graph_path or fallback" 2>&1 | tail -3) | tee $OUT/cuda_new.log
date
timeout 140 python .devrun/s12/occ.py > $OUT/occ.log 2>&1; grep -v Warn $OUT/occ.log
date
(cd benchmarks && timeout 100 python kernels.py --quant-only --breakdown --contexts 65536,131072 --out $OUT/k-off.json > $OUT/k-off.log 2>&1)
(cd benchmarks && HF_SPARSEKV_QUANT_CONFIG='{"merge_buffer": true}' timeout 100 python kernels.py --quant-only --breakdown --contexts 65536,131072 --out $OUT/k-on.json > $OUT/k-on.log 2>&1)
grep -v Warn $OUT/k-off.log $OUT/k-on.log | grep -v "^ *warn"
date
