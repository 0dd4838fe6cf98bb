#!/usr/bin/env bash
# Session 14's device calls (what ran, for docs/BENCHMARKS.md and notes/KERNELS.md):
#   explore   GPU tests (greedy argmax with its counters, the greedy decode graph, the
#             GEMV chain under PDL with L2 prefetch), then decode.py at 32k, int4: the
#             greedy graph step (argmax captured with the step, the default) against
#             decode_step + sample (step.greedy=0); GEMVs asking L2 for their first W
#             steps before their PDL wait (qkv / gate_up / every launch); gate/up with a
#             second pipeline stage or 4 + 4 rows x 2 KiB per step
# Usage: OUT=$OUT bash benchmarks/h200_s14.sh explore   (results: $OUT/r/)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh  # $R, $XDIST, $R/gpu.txt, PYTHONPATH, gpu_tests, decode_variants
what=${1:?what}; shift
case $what in
explore)
  gpu_tests tests.log 150 tests/test_argmax.py tests/test_runner.py tests/test_runner_compile.py \
    tests/test_gemv.py
  decode_variants explore 420 int4 ";step.greedy=0;qkv.prefetch=1;qkv.prefetch=2;gate_up.prefetch=1;gemv.prefetch=1;gate_up.num_stages=2;gate_up.block_n=4,gate_up.block_k=1024,gate_up.fold=2" --contexts 32k
  ;;
*) echo "unknown case $what"; exit 2 ;;
esac
