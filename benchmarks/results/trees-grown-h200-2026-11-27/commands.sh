# call 1 (cut at each limit: cold Inductor/Triton caches)
#!/bin/bash
# call 1: kernel tests (tree / ring), the captured drafter-tree tests (chunk, window, full), bundled pair end to end
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 100 python -m pytest -q -x tests/test_kernels.py -k "tree or window" -p no:cacheprovider > $OUT/kernels.log 2>&1; echo "kernels rc=$?"; tail -3 $OUT/kernels.log
timeout 200 python -m pytest -q -rfE tests/test_cuda.py -k "test_draft_trees_on_the_captured" -m "cuda" -p no:cacheprovider --durations=5 > $OUT/cuda_trees.log 2>&1; echo "cuda trees rc=$?"; tail -12 $OUT/cuda_trees.log
cd benchmarks
timeout 270 python graph_engine.py --contexts 16384 --docs 1 --repeats 3 --new-tokens 256 --budgets 256 --gammas 5 \
  --only hf-static-ar,graph-ar,chunk-256-g5,window-g5 \
  --extra chunk-256-g5-t16,chunk-256-g5-t32,window-g5-t16,window-g5-t32 --out $OUT/bundled > $OUT/bundled.log 2>&1
echo "e2e rc=$?"; grep "^|" $OUT/bundled.log | tail -14

# call 2
#!/bin/bash
# call 2 (warm machine, Inductor cache of call 1): bundled pair end to end; the captured drafter-tree test (chunk)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
cd benchmarks
timeout 330 python graph_engine.py --contexts 16384 --docs 1 --repeats 3 --new-tokens 256 --budgets 256 --gammas 5 \
  --only hf-static-ar,graph-ar,chunk-256-g5,window-g5 \
  --extra chunk-256-g5-t16,chunk-256-g5-t32,window-g5-t16,window-g5-t32 --out $OUT/bundled > $OUT/bundled.log 2>&1
echo "e2e rc=$?"; grep "^|" $OUT/bundled.log | tail -14
cd ..
timeout 250 python -m pytest -q -rfE tests/test_cuda.py -k "test_draft_trees_on_the_captured and chunk" -p no:cacheprovider --durations=5 > $OUT/cuda_trees.log 2>&1; echo "cuda trees rc=$?"; tail -12 $OUT/cuda_trees.log

# call 3
#!/bin/bash
# call 3: Llama-3.1-8B + 3.2-1B shape (random bf16 weights): the 1B drafter's chain and tree rounds (batch 1, 16K);
# chain vs tree verification at batch 4 and 16 (16K)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 250 python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 --batches 1 \
  --only draft-chunk-1024 draft-chunk-1024-t16 draft-chunk-1024-t32 --out $OUT/draft > $OUT/draft.log 2>&1
echo "draft rc=$?"; grep -E "copy rate|^  " $OUT/draft.log | tail -8
timeout 320 python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 --batches 4 16 \
  --only verify-6 verify-tree-16 verify-tree-32 --out $OUT/batch > $OUT/batch.log 2>&1
echo "batch rc=$?"; grep -E "copy rate|^  " $OUT/batch.log | tail -12

# call 4
timeout 280 python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 --batches 16 --only verify-6 verify-tree-16 --out $OUT/b16
