#!/bin/bash
# session 10, call 3 (two GPUs): the drafter's two-stage vocabulary top-k in tree rounds.
# GPU 0: bundled pair at 16K, best chains (γ 5, 7) against trees (γ 5 / 7, N 16), profile of a tree round.
# GPU 1: Llama-3.1-8B + 3.2-1B shape (random bf16 weights), the 1B drafter's chain and tree rounds at 16K, and the
# verification chain vs tree, batch 1.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
cd benchmarks
CUDA_VISIBLE_DEVICES=1 timeout 420 python scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 --batches 1 \
  --only draft-chunk-1024 draft-chunk-1024-t16 --out $OUT/draft > $OUT/draft.log 2>&1 &
CUDA_VISIBLE_DEVICES=0 timeout 420 python graph_engine.py --contexts 16384 --docs 1 --repeats 3 --new-tokens 256 \
  --budgets 256 --gammas 5,7 --only hf-static-ar,graph-ar,chunk-256-g7 \
  --extra chunk-256-g5-t16,chunk-256-g7-t16 --profile chunk-256-g7-t16 --out $OUT/bundled > $OUT/bundled.log 2>&1
echo "e2e rc=$?"; grep "^|" $OUT/bundled.log | tail -10
wait
echo "draft:"; grep -E "copy rate|^\| |^  " $OUT/draft.log | tail -12
head -40 $OUT/bundled/profile-chunk-256-g7-t16.txt | cut -c1-100,200-330
