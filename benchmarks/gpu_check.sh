#!/usr/bin/env bash
# One device call: the kernel tests on the GPU, then the attention benchmark.
# Usage (repo root, on a CUDA machine): OUT_DIR=/some/dir bash benchmarks/gpu_check.sh [bench args...]
# TEST_S / BENCH_S bound each phase (seconds) so a run fits its lease.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
OUT=${OUT_DIR:-/tmp/kvtax-gpu}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
XDIST=""
python -c "import xdist" 2>/dev/null && XDIST="-n ${TEST_WORKERS:-12}"
timeout "${TEST_S:-200}" python -m pytest -q -p no:cacheprovider $XDIST \
    ${TEST_FILES:-tests/attention/test_kernels_gpu.py tests/attention/test_kernels_interp.py} > "$OUT/tests.log" 2>&1
echo "tests exit $?"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
timeout "${BENCH_S:-260}" python benchmarks/attention.py --out "$OUT/bench" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\(decode\|prefill\) " 
echo "bench exit ${PIPESTATUS[0]}"
