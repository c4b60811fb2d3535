#!/bin/bash
# session 10, call 1 (two GPUs, in parallel): GPU 0 the bundled pair at 16K, chain vs tree, per-round split and
# torch.profiler of one chain and one tree run; GPU 1 the captured, compiled tree tests (window, full) and the
# tree kernel tests.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 > $OUT/commit.txt 2>/dev/null
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 500 python -m pytest -q -rfE tests/test_cuda.py -k "test_draft_trees_on_the_captured and (window or full)" \
    -p no:cacheprovider --durations=5 > $OUT/cuda_trees.log 2>&1; echo "cuda trees rc=$?" >> $OUT/cuda_trees.log
  timeout 60 python -m pytest -q -x tests/test_kernels.py -k "tree or window" -p no:cacheprovider > $OUT/kernels.log 2>&1
  echo "kernels rc=$?" >> $OUT/kernels.log
) &
cd benchmarks
CUDA_VISIBLE_DEVICES=0 timeout 540 python graph_engine.py --contexts 16384 --docs 1 --repeats 3 --new-tokens 256 \
  --budgets 256 --gammas 5,7 --only hf-static-ar,graph-ar,chunk-256-g5,chunk-256-g7 \
  --extra chunk-256-g5-t16,chunk-256-g7-t16,chunk-256-g7-t32 \
  --profile chunk-256-g5,chunk-256-g5-t16 --out $OUT/bundled > $OUT/bundled.log 2>&1
echo "e2e rc=$?"; grep "^|" $OUT/bundled.log | tail -10
wait
tail -5 $OUT/cuda_trees.log; tail -3 $OUT/kernels.log
head -60 $OUT/bundled/profile-chunk-256-g5-t16.txt 2>/dev/null
