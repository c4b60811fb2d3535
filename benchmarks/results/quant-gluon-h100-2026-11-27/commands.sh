export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
set -o pipefail
(python -m pytest tests/test_quant_gluon.py -m cuda -q -x --durations=5 2>&1 | tail -15) | tee $OUT/cuda_gluon.log
python .devrun/gl/sweep.py float16 --final 2>&1 | tee $OUT/final_fp16.log
python .devrun/gl/sweep.py bfloat16 --final 2>&1 | tee $OUT/final_bf16.log
PYTHONPATH=$PWD timeout 250 python benchmarks/graph_engine.py --contexts 16384 --docs 2 --repeats 3 --new-tokens 256 --only hf-static-ar,graph-ar,int4-self-g5 --gammas 5 --out $OUT/e2e 2>&1 | grep -v Warning | tail -25 | tee $OUT/e2e.log
(python -m pytest tests/test_kernels.py -m "cuda and not slow" -q -k "quant or real_size" --durations=5 2>&1 | tail -8) | tee $OUT/cuda_kernels.log
