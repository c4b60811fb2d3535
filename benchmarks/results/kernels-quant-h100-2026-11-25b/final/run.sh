#!/usr/bin/env bash
# device run 15: final quantized table (fp16, bf16) with the fill rule, short contexts with / without it, CUDA quant
# + int4 graph tests, int4 e2e
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for dt in float16 bfloat16; do
  timeout 75 python benchmarks/kernels.py --quant-only --dtype $dt --contexts 65536,131072 --out $OUT/kernels-quant-$dt.json 2>&1 | grep -v Warning > $OUT/kernels-quant-$dt.log
  grep -E "quant_int|sdpa|copy" $OUT/kernels-quant-$dt.log | head -13
done
for fill in 0 4; do
  HF_SPARSEKV_QUANT_CONFIG="{\"fill_per_sm\": $fill}" timeout 50 python benchmarks/kernels.py --quant-only --contexts 4096,16384 --out $OUT/kernels-quant-short-fill$fill.json 2>&1 | grep -v Warning > $OUT/kernels-quant-short-fill$fill.log
  echo "fill_per_sm=$fill"; grep -E "quant_int|sdpa" $OUT/kernels-quant-short-fill$fill.log | head -12
done
t0=$(date +%s)
timeout 110 python -m pytest -p no:warnings tests/test_kernels.py tests/test_cuda.py -m "cuda and not slow" -k "quant or int4 or batched" 2>&1 | tail -3 > $OUT/cuda_quant.log; cat $OUT/cuda_quant.log
echo "tests: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 190 python benchmarks/graph_engine.py --contexts 16384 --docs 2 --repeats 3 --new-tokens 256 --only hf-static-ar,graph-ar,int4-self-g5 --gammas 5 --out $OUT/int4-e2e > $OUT/int4-e2e.log 2>&1
tr '\r' '\n' < $OUT/int4-e2e.log | grep -v -i "warn\|it/s\]\|Loading" | tail -7
echo "e2e: $(( $(date +%s) - t0 )) s"
