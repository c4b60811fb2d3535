#!/usr/bin/env bash
# Nsight Compute of the register ("vec") path at HEAD (fold + mantissa codes + fill), Llama-2-7B shape, 64K, fp16:
# the one-row path had only been profiled at the 1db45a0 configuration (before the fold).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
S=benchmarks/results/quant-ncu-h100-2026-11-25/ncu_quant.py
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for view in int4 int8; do
  timeout 60 ncu -k regex:decode_split -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section InstructionStats python $S llama2-7b $view > $OUT/ncu_llama2_$view.txt 2>&1
  grep -E "Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Theoretical Occ|Achieved Occ|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A|Memory Throughput +Gbyte|Spilling Requests +[0-9]" $OUT/ncu_llama2_$view.txt
done
