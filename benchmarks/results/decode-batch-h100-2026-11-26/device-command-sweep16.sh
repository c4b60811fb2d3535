#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 400 python3 benchmarks/decode_kernel.py --sweep --sweep-batch 16 --sweep-contexts 8192 32768 --batches 16 --queries 1 6 --contexts 8192 32768 131072 --out $OUT/sw16 > $OUT/sw16.log 2>&1
echo "sweep16 rc=$? $(( $(date +%s) - T0 ))s"; grep "winner" $OUT/sw16.log; grep " us " $OUT/sw16.log | tail -6
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/sw16/decode_kernel.json"))
rows = sorted((r for r in d["sweep"] if "ms" in r), key=lambda r: r["total_ms"])
for r in rows[:10] + [r for r in rows if r["config"] == dict(block_n=64, num_warps=4, num_stages=4, programs_per_sm=4)]:
    print(r["config"], " ".join(f"{t*1e3:.1f}" for t in r["ms"]), f"{r['total_ms']*1e3:.1f}")
PY
