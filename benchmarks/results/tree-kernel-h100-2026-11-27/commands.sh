#!/bin/bash
# call 1: tree attention kernel, old (HEAD before this session) vs new with a sweep of the wide settings; CUDA kernel tests
export PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
cd $ROOT/benchmarks
PYTHONPATH=$ROOT/.devrun/old timeout 120 python decode_kernel.py --tree --contexts 16384 32768 --out $OUT/old > $OUT/old.log 2>&1
tail -8 $OUT/old.log
PYTHONPATH=$ROOT timeout 300 python decode_kernel.py --tree-sweep --contexts 16384 32768 --out $OUT/new > $OUT/new.log 2>&1
grep -v "^tree sweep {" $OUT/new.log | tail -12
python - <<"P"
import json,os
d=json.load(open(os.environ["OUT"]+"/new/tree_kernel.json"))
for r in sorted([r for r in d["sweep"] if "ms" in r], key=lambda r: r["total_ms"])[:6]: print(r["config"], [round(t*1e3,1) for t in r["ms"]])
P
cd $ROOT
PYTHONPATH=$ROOT timeout 200 python -m pytest -q tests/test_kernels.py -p no:cacheprovider --durations=5 > $OUT/cuda_kernels.log 2>&1
tail -5 $OUT/cuda_kernels.log
#!/bin/bash
# call 2: CUDA kernel tests (cuda-marked), tree verification at Llama-3.1-8B shape (batch 1, 16K/32K), profile of the 33-token tree step
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 120 python -m pytest -q -x tests/test_kernels.py -m cuda -p no:cacheprovider > $OUT/cuda_kernels.log 2>&1; echo "kernel tests rc=$?"; tail -3 $OUT/cuda_kernels.log
timeout 420 python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 32768 --batches 1 \
  --only verify-6 verify-tree-16 verify-tree-32 --out $OUT/scale1 --profile 32768 --profile-steps verify-tree-32 > $OUT/scale1.log 2>&1
echo "scale rc=$?"; grep -v "^\s*$" $OUT/scale1.log | tail -40
#!/bin/bash
# call 5: bundled pair at 16K end to end, chains vs trees (γ = 5); then the tree / graph-path CUDA tests, timestamped
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
cd benchmarks
timeout 440 python graph_engine.py --contexts 16384 --docs 1 --repeats 3 --new-tokens 256 --budgets 256 --gammas 3,5 \
  --only hf-static-ar,graph-ar,chunk-256-g5,window-g5,lookup-g3 \
  --extra chunk-256-g5-t16,chunk-256-g5-t32,window-g5-t16 --out $OUT/bundled > $OUT/bundled.log 2>&1
echo "e2e rc=$?"; grep "^|" $OUT/bundled.log | tail -14
cd ..
timeout 130 python -m pytest -p no:cacheprovider -v -rfE tests/test_cuda.py -k "draft_trees or test_graph_path_lossless_float32" 2>&1 | while IFS= read -r line; do echo "$(date +%s) $line"; done > $OUT/cuda_trees.log
grep -E "PASSED|FAILED|ERROR" $OUT/cuda_trees.log | sed 's/^.*tests/tests/' | cut -c1-150
#!/bin/bash
# call 7: the CUDA suite with a per-test limit (pytest-timeout) and every duration
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 560 python -m pytest tests -m "cuda and not slow" -p no:cacheprovider -q -rfE --timeout=75 --timeout-method=signal --durations=0 > $OUT/suite.log 2>&1
echo "rc=$?"; grep -E "^[0-9.]+s (call|setup)|passed|failed|Timeout|FAILED" $OUT/suite.log | head -50
#!/bin/bash
# call 8: the four tree tests cut by call 7's 75 s per-test limit, with a longer limit and durations
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 540 python -m pytest -p no:cacheprovider -q -rfE --timeout=240 --durations=0 \
  "tests/test_cuda.py::test_prompt_lookup_beside_a_drafter_on_the_captured_engine_float32[chunk]" \
  "tests/test_cuda.py::test_draft_trees_on_the_captured_engine_float32[window]" \
  "tests/test_cuda.py::test_draft_trees_on_the_captured_engine_float32[chunk]" \
  "tests/test_cuda.py::test_prompt_lookup_beside_a_drafter_on_the_captured_engine_float32[window]" > $OUT/trees.log 2>&1
echo "rc=$?"; grep -E "^[0-9.]+s |passed|failed|Error|assert" $OUT/trees.log | head -30
