#!/usr/bin/env bash
# Session 14's device calls (what ran, for docs/BENCHMARKS.md and notes/KERNELS.md):
#   explore   GPU tests (greedy argmax with its counters, the greedy decode graph, the
#             GEMV chain under PDL with L2 prefetch), then decode.py at 32k, int4: the
#             greedy graph step (argmax captured with the step, the default) against
#             decode_step + sample (step.greedy=0); GEMVs asking L2 for their first W
#             steps before their PDL wait (qkv / gate_up / every launch); gate/up with a
#             second pipeline stage or 4 + 4 rows x 2 KiB per step
#   rope      GPU tests (the qkv GEMV building RoPE tables from the positions, W tiles
#             held across the PDL wait in W's dtype, the greedy graph), then decode.py at
#             32k, int4 / int8 / bf16: the defaults (tables built in the qkv GEMV) against
#             the step's tables (step.rope_freqs=0); the GEMVs' wait after their first W
#             tile now that the held tile is half the registers (pdl.first=4: qkv too;
#             2: all but qkv; 1: all); gate/up with two stages, qkv asking L2 for its
#             first step, and both
#             (the in-kernel tables measured slower and were reverted, 75323d9)
#   final     GPU tests (GEMV, decoder, runner, argmax, PDL), then issue 4's benchmark at
#             32k / 64k / 128k, bf16 / int8 / int4: the defaults (qkv, o, down waiting
#             after their first W tile: gemv.PDL_FIRST 4) against session 13's placement
#             (pdl.first=3: o and down only), side by side in one process
#   early     GPU tests (GEMV, decoder), then decode.py at 32k, int4 / int8 / bf16: the qkv
#             GEMV's rotation factors read (or computed from the positions) right after
#             its PDL wait instead of in its epilogue: tables or positions x early or late
#             (ROPE_EARLY measured no faster and was dropped; the positions kept: 85fc0f6)
#   record    GPU tests (GEMV, decoder, runner, argmax), then issue 4's benchmark at 32k /
#             64k / 128k, bf16 / int8 / int4 with the final defaults (the greedy graph
#             step, RoPE tables built in the qkv GEMV, qkv / o / down waiting after
#             their first W tile)
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
rope)
  gpu_tests tests.log 170 tests/test_gemv.py tests/test_gemv_decoder.py tests/test_runner.py \
    tests/test_pdl.py tests/test_pdl_gpu.py tests/test_argmax.py
  B="gate_up.num_stages=2,qkv.prefetch=1"
  decode_variants rope-int4 260 int4 ";step.rope_freqs=0;pdl.first=4;pdl.first=2;pdl.first=1;gate_up.num_stages=2;qkv.prefetch=1;$B;$B,pdl.first=4" --contexts 32k
  decode_variants rope-int8 130 int8 ";step.rope_freqs=0;$B;pdl.first=4" --contexts 32k
  decode_variants rope-bf16 130 bf16 ";step.rope_freqs=0;$B;pdl.first=4" --contexts 32k
  ;;
final)
  gpu_tests tests.log 120 tests/test_gemv.py tests/test_gemv_decoder.py tests/test_runner.py \
    tests/test_argmax.py tests/test_pdl.py tests/test_pdl_gpu.py
  timeout 400 python3 benchmarks/decode.py --contexts 32k,64k,128k --kv bf16,int8,int4 \
    --compile on --tokens 32 --warmup 4 --variants ";pdl.first=3" --out "$R/decode.json" \
    > "$R/decode.log" 2>&1
  grep -E "^\||^#" "$R/decode.log"
  ;;
early)
  gpu_tests tests.log 100 tests/test_gemv.py tests/test_gemv_decoder.py
  V=";step.rope_freqs=0;step.rope_early=0;step.rope_freqs=0,step.rope_early=0"
  decode_variants early-int4 150 int4 "$V" --contexts 32k
  decode_variants early-int8 150 int8 "$V" --contexts 32k
  decode_variants early-bf16 150 bf16 "$V" --contexts 32k
  ;;
record)
  gpu_tests tests.log 70 tests/test_gemv.py tests/test_gemv_decoder.py tests/test_runner.py \
    tests/test_argmax.py
  timeout 250 python3 benchmarks/decode.py --contexts 32k,64k,128k --kv bf16,int8,int4 \
    --compile on --tokens 32 --warmup 4 --out "$R/decode.json" > "$R/decode.log" 2>&1
  grep -E "^\||^#" "$R/decode.log"
  ;;
*) echo "unknown case $what"; exit 2 ;;
esac
