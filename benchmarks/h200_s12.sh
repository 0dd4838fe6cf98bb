#!/usr/bin/env bash
# Session 12's device calls (what ran, for docs/BENCHMARKS.md and notes/KERNELS.md):
#   pdl     GPU tests with every decode-step kernel PDL-aware (kvtax.pdl: GEMVs, cache
#           store, decode attention, split-KV reduce), then decode.py side by side in one
#           process: PDL off / GEMVs only (session 11's default) / every kernel, 32k bf16 /
#           int8 / int4 and 128k int4
#   balance the GEMV PDL test (fixed), then decode.py at 32k: the attention kernels
#           launched with PDL or not (pdl.attn=0: they still trigger the reduce early), and
#           with as many programs per SM as fit (int8 12, bf16 6): an early-launched grid's
#           programs land where there is room, so a grid sized below the occupancy limit
#           (int8 8 per SM, bf16 4) can land unevenly
#   late    the PDL GPU tests (dependents let go first thing and at the end), then decode.py
#           at 32k, bf16 / int8 / int4: PDL off / GEMVs only / every kernel / the decode
#           attention kernels (and the reduce) letting the next kernel launch at their end
#   record  GPU tests with the per-kernel PDL defaults (swap_decode_config / warp_decode_
#           config: int4 launched early, letting go first thing; int8 launched early,
#           letting go at its end; bf16 (decode_warp) launched normally, letting go at its
#           end), bf16 at 32k against its alternatives, then issue 4's benchmark at 32k /
#           64k / 128k, bf16 / int8 / int4, profiled
#   final   issue 4's benchmark at 32k / 64k / 128k, bf16 / int8 / int4, each cell with the
#           defaults and with PDL off (pdl.on=0), side by side in one process
#   int8    int8 at 32k / 128k: the swap kernel below 12 per SM launched normally (the new
#           default) / launched early (attn.pdl_launch=1) / PDL off
#   kvstore (experiment eb2e5dc, reverted) GEMV / decoder / runner GPU tests with the qkv
#           GEMV writing K / V into the cache (gemv's kv_store), then decode.py at 32k,
#           bf16 / int8 / int4, with it and with the cache's store kernel (fuse.store=0)
# Usage: OUT=$OUT bash benchmarks/h200_s12.sh pdl   (results: $OUT/r/)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh  # $R, $XDIST, $R/gpu.txt, PYTHONPATH, gpu_tests, decode_variants
what=${1:?what}; shift
GEMV_ONLY="pdl.store=0,pdl.attn=0,pdl.reduce=0"
case $what in
pdl)
  gpu_tests pdl-tests.log 200 tests/test_pdl_gpu.py tests/test_gemv.py tests/test_runner.py \
    tests/test_kernels_swap_gpu.py tests/test_gemv_decoder.py
  decode_variants pdl-32k 300 bf16,int8,int4 "pdl.on=0;$GEMV_ONLY;" --contexts 32k
  decode_variants pdl-128k 120 int4 "$GEMV_ONLY;" --contexts 128k
  ;;
balance)
  gpu_tests pdl-tests.log 100 tests/test_gemv.py tests/test_pdl_gpu.py
  decode_variants bal-bf16 200 bf16 "$GEMV_ONLY;pdl.attn=0;attn.per_sm=6;attn.per_sm=6,pdl.attn=0" --contexts 32k
  decode_variants bal-int8 200 int8 "$GEMV_ONLY;pdl.attn=0;attn.per_sm=12;attn.per_sm=12,pdl.attn=0" --contexts 32k
  decode_variants bal-int4 150 int4 "$GEMV_ONLY;pdl.attn=0;" --contexts 32k
  ;;
late)
  gpu_tests pdl-tests.log 100 tests/test_pdl_gpu.py tests/test_gemv.py tests/test_bench_variants.py
  for kv in bf16 int8 int4; do
    decode_variants late-$kv 200 $kv "pdl.on=0;$GEMV_ONLY;;pdl.attn_late=1;pdl.attn_late=1,pdl.reduce_late=1" --contexts 32k
  done
  ;;
record)
  gpu_tests pdl-tests.log 200 tests/test_pdl_gpu.py tests/test_gemv.py tests/test_runner.py \
    tests/test_kernels_swap_gpu.py tests/test_gemv_decoder.py
  decode_variants rec-bf16 150 bf16 ";attn.pdl_launch=1;attn.pdl_late=0;$GEMV_ONLY" --contexts 32k
  timeout 300 python3 benchmarks/decode.py --contexts 32k,64k,128k --kv bf16,int8,int4 \
    --compile on --tokens 32 --warmup 4 --profile 2 --out "$R/decode.json" > "$R/decode.log" 2>&1
  grep -E "^\||^#" "$R/decode.log"
  ;;
final)
  timeout 400 python3 benchmarks/decode.py --contexts 32k,64k,128k --kv bf16,int8,int4 \
    --compile on --tokens 32 --warmup 4 --variants ";pdl.on=0" --out "$R/decode.json" \
    > "$R/decode.log" 2>&1
  grep -E "^\||^#" "$R/decode.log"
  ;;
int8)
  timeout 300 python3 benchmarks/decode.py --contexts 32k,128k --kv int8 \
    --compile on --tokens 32 --warmup 4 --variants ";attn.pdl_launch=1;pdl.on=0" \
    --out "$R/int8.json" > "$R/int8.log" 2>&1
  grep -E "^\||^#" "$R/int8.log"
  ;;
kvstore)  # at eb2e5dc (the experiment; reverted in 365ef17: measured no faster)
  gpu_tests kv-tests.log 120 tests/test_gemv.py tests/test_gemv_decoder.py tests/test_runner.py
  for kv in int4 int8 bf16; do
    decode_variants kv-$kv 60 $kv ";fuse.store=0" --contexts 32k
  done
  ;;
*) echo "unknown case $what"; exit 2 ;;
esac
