#!/bin/bash
# session 10, call 4: the grouped GEMV at 17-64 rows (tree verifications, batch verify steps) against cuBLAS
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
cd benchmarks
timeout 170 python linear_kernels.py --models llama-3.1-8b qwen2.5-0.5b --rows 16 24 33 64 --repeats 10 \
  --out $OUT/lin 2>&1 | grep -v warn | tee $OUT/lin.log | tail -45
cd ..
timeout 45 python -m pytest -q -x tests/test_kernels.py -k "cuda_grouped" -p no:cacheprovider 2>&1 | tail -3
