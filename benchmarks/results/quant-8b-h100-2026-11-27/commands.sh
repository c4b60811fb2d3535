#!/bin/bash
# call 1: where the quantized launch's time goes; ncu of the Gluon kernel; CUDA tests; 8B steps with the new kernel
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 > $OUT/commit.txt
timeout 150 python .devrun/s12/prof.py all > $OUT/prof.log 2>&1; echo "prof rc=$?"; cat $OUT/prof.log | grep -v Warn
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for c in "int4 1" "int8 1" "int8 6"; do
  set -- $c
  timeout 90 $NCU --clock-control none --kernel-name regex:"quant_split|combine|decode_split" --launch-skip 3 --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis python .devrun/s12/ncu_target.py $1 $2 > $OUT/ncu-$1-L$2.txt 2>&1
  echo "ncu $1 $2 rc=$?"
done
grep -E "^  [a-z_]+kernel|Duration|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Issue Slots Busy|No Eligible|Stall|Warp Cycles Per Issued" $OUT/ncu-int4-L1.txt | head -60
(timeout 200 python -m pytest tests/test_quant_gluon.py -m cuda -q -x --durations=5 2>&1 | tail -8) | tee $OUT/cuda_gluon.log
timeout 280 python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 32768 131072 --batches 1 \
  --only ar int4-w4-draft int4-verify --profile 32768 --profile-steps int4-w4-draft int4-verify --out $OUT/scale > $OUT/scale.log 2>&1
echo "scale rc=$?"; grep -E "copy rate|^\[|^\| llama|^  [a-z]" $OUT/scale.log | tail -24
#!/bin/bash
# call 2: the launch after the combine change (per kernel; zero- and read-flush); 8B steps at 32K/128K batch 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 > $OUT/commit.txt
timeout 100 python .devrun/s12/prof.py > $OUT/prof.log 2>&1; echo "prof rc=$?"; grep -v Warn $OUT/prof.log
timeout 470 python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 32768 131072 --batches 1 \
  --only ar int4-w4-draft int4-verify --out $OUT/scale > $OUT/scale.log 2>&1
echo "scale rc=$?"; grep -E "copy rate|^\[|^\| llama|^  [a-z]" $OUT/scale.log | tail -24
#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 > $OUT/commit.txt
(timeout 150 python -m pytest tests/test_quant_gluon.py -m cuda -q -x 2>&1 | tail -3) | tee $OUT/cuda_gluon.log
timeout 420 python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 32768 65536 131072 --batches 1 \
  --only ar int4-w4-draft int4-verify --out $OUT/scale > $OUT/scale.log 2>&1
echo "scale rc=$?"; grep -E "copy rate|^\[|^\| llama|^  [a-z]" $OUT/scale.log | tail -24
