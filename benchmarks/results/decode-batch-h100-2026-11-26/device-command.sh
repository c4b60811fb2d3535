#!/bin/bash
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
T0=$(date +%s)
timeout 330 python3 benchmarks/decode_kernel.py --sweep --sweep-batch 4 --sweep-contexts 16384 131072 --batches 1 4 --queries 1 6 --contexts 8192 32768 131072 --out $OUT/sw4 > $OUT/sw4.log 2>&1
echo "sweep4 rc=$? $(( $(date +%s) - T0 ))s"; grep "winner" $OUT/sw4.log; grep "total" $OUT/sw4.log | sort -t'l' -k3 | awk '{print}' | python3 -c "
import sys,re
rows=[(float(re.search(r'total ([0-9.]+)',l).group(1)),l.strip()) for l in sys.stdin if 'total' in l]
for t,l in sorted(rows)[:8]: print(l)
"; grep " us " $OUT/sw4.log | tail -12
timeout 240 python3 -m pytest tests -m "cuda and not slow" -q -x -p no:cacheprovider --durations=5 > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; tail -8 $OUT/tests.log
