#!/bin/bash
# session 10, call 2 (two GPUs): programmatic dependent launch (PDL) on / off.
# GPU 0: PDL on; GPU 1: PDL off, at once: the 8B AR step and the 1B draft steps at 16K / 32K (random bf16 weights);
# then on each GPU the other setting's 1B draft steps (warm), so each GPU has both; then the decode kernel, batch 1,
# both settings on GPU 0; the CUDA kernel tests and a compiled graph test with PDL on, on GPU 1.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
cd benchmarks
steps() {  # GPU PDL tag steps...
  local gpu=$1 pdl=$2 tag=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu HF_SPARSEKV_PDL=$pdl timeout 330 python scale.py --pairs llama-3.1-8b+3.2-1b \
    --contexts 16384 32768 --batches 1 --only "$@" --out $OUT/$tag > $OUT/$tag.log 2>&1
  echo "$tag rc=$?" >> $OUT/rc.txt
}
steps 0 1 gpu0-pdl1 ar draft-chunk-1024 draft-window-1024 verify-6 &
steps 1 0 gpu1-pdl0 ar draft-chunk-1024 draft-window-1024 verify-6 &
wait
steps 0 0 gpu0-pdl0 draft-chunk-1024 draft-window-1024 &
steps 1 1 gpu1-pdl1 draft-chunk-1024 draft-window-1024 &
wait
cat $OUT/rc.txt
for t in gpu0-pdl1 gpu1-pdl0 gpu0-pdl0 gpu1-pdl1; do echo "== $t"; grep -E "copy rate|^\| *(ar|draft|verify)|^  " $OUT/$t.log | head -12; done
(
  for pdl in 1 0 1 0; do
    CUDA_VISIBLE_DEVICES=0 HF_SPARSEKV_PDL=$pdl timeout 60 python decode_kernel.py --batches 1 --queries 1 6 \
      --contexts 8192 16384 32768 131072 --out $OUT/decode-pdl$pdl-$RANDOM > $OUT/decode-pdl$pdl.log 2>&1
    echo "== decode pdl=$pdl"; grep "^|" $OUT/decode-pdl$pdl.log | tail -9
  done
) > $OUT/decode.txt 2>&1 &
cd ..
CUDA_VISIBLE_DEVICES=1 timeout 200 python -m pytest -q -x tests/test_kernels.py -m cuda -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "kernel tests rc=$?"; tail -3 $OUT/kernel_tests.log
CUDA_VISIBLE_DEVICES=1 timeout 150 python -m pytest -q -x tests/test_cuda.py -m "cuda and not slow" -k "test_graph_path_lossless_float32 or grouped_kernel or batch_rows_equal_each" -p no:cacheprovider --maxfail=1 > $OUT/cuda_tests.log 2>&1
echo "cuda tests rc=$?"; tail -3 $OUT/cuda_tests.log
wait
cat $OUT/decode.txt
