export PYTHONPATH=.
start=$(date +%s)
timeout 280 python3 -m pytest tests -m "cuda and not slow" -v --durations=12 -p no:cacheprovider 2>&1 | while IFS= read -r l; do echo "$(( $(date +%s) - start )) $l"; done > $OUT/cuda_tests.log
echo done in $(( $(date +%s) - start )) s; grep -E "passed|failed|FAILED|ERROR" $OUT/cuda_tests.log | tail -8; tail -16 $OUT/cuda_tests.log
