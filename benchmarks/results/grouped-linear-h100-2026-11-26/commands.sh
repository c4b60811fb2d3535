#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 150 python3 -m pytest tests/test_kernels.py tests/test_cuda.py -k "grouped or compiled_graph_path_lossless or graph_greedy_ar_equals" -m cuda -rfE -p no:cacheprovider -q > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; tail -4 $OUT/tests.log
timeout 260 python3 benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 32768 65536 131072 --batches 1 --only ar verify-4 verify-6 draft-chunk-1024 draft-window-1024 --profile 32768 --out $OUT/on > $OUT/on.log 2>&1
echo "on rc=$? $(( $(date +%s) - T0 ))s"; grep "^\[" $OUT/on.log
HF_SPARSEKV_GROUPED_LINEAR=0 timeout 160 python3 benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 32768 --batches 1 --only ar verify-6 draft-chunk-1024 draft-window-1024 --out $OUT/off > $OUT/off.log 2>&1
echo "off rc=$? $(( $(date +%s) - T0 ))s"; grep "^\[" $OUT/off.log
#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 330 python3 benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 32768 65536 131072 --batches 1 --only ar verify-4 verify-6 draft-full draft-chunk-1024 draft-window-1024 --out $OUT/on > $OUT/on.log 2>&1
echo "on rc=$? $(( $(date +%s) - T0 ))s"; grep "^\[" $OUT/on.log
HF_SPARSEKV_GROUPED_LINEAR=0 timeout 230 python3 benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 131072 --batches 1 --only ar verify-6 draft-chunk-1024 draft-window-1024 --out $OUT/off > $OUT/off.log 2>&1
echo "off rc=$? $(( $(date +%s) - T0 ))s"; grep "^\[" $OUT/off.log
#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 320 python3 benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 32768 131072 --batches 1 --only hf-static-ar graph-ar --repeats 1 --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s) - T0 ))s"; grep "^  \|^\[\|^|" $OUT/e2e.log | tail -12
for g in 1 0; do
HF_SPARSEKV_GROUPED_LINEAR=$g timeout 120 python3 benchmarks/graph_engine.py --contexts 16384 --docs 1 --repeats 3 --new-tokens 256 --budgets 256 --gammas 3 --only hf-static-ar,graph-ar,chunk-256-g3,window-g3 --out $OUT/ge$g > $OUT/ge$g.log 2>&1
echo "ge$g rc=$? $(( $(date +%s) - T0 ))s"; grep "^|" $OUT/ge$g.log | head -8
done
#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 520 python3 benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 32768 131072 --batches 1 --only ar int4-w4-draft int4-verify draft-window-1024 --out $OUT/int4 > $OUT/int4.log 2>&1
echo "int4 rc=$? $(( $(date +%s) - T0 ))s"; grep "^  \|^\[" $OUT/int4.log | tail -12; grep "^|" $OUT/int4.log | tail -14
