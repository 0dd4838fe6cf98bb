#!/usr/bin/env bash
# Session 13's device calls (what ran, for docs/BENCHMARKS.md and notes/KERNELS.md):
#   prefetch  (at 07d4f2c; attn.prefetch was reverted after it measured no faster)
#             GPU tests (PDL with the decode kernels prefetching, the GEMV chain with each
#             wait placement), then decode.py at 32k, int4 and int8, side by side: the
#             defaults / the o and down GEMVs waiting after their first W tile
#             (pdl.first=3) / every GEMV but qkv's (pdl.first=2) / the decode attention
#             pulling its first 2 or 8 tiles per program into L2 before its PDL wait
#             (attn.prefetch), launched early or not
#   bf16      (at fd695e7, attn.prefetch since reverted) the same for bf16 (decode_warp); then 4k and 32k, bf16 / int8 / int4, PDL on
#             and off, with the step's critical path by kernel role (decode.py's
#             critical_us_by_role: what each kernel adds to the step's span)
#   argmax    GPU tests (the one-launch greedy argmax, PDL, runner, GEMVs, swap kernels),
#             then decode.py with the new defaults (greedy argmax kernel; o / down GEMVs
#             waiting after their first W tile; int4's attention launched early only
#             where its grid fills every SM): int4 at 4k / 32k against an early launch
#             and against waiting first thing (pdl.first=0), int8 at 32k against it
#   fold      GEMV / decoder GPU tests, then decode.py at 32k with the GEMVs summing each
#             step's products in groups of 4 or 8 columns (GemvConfig.fold: accumulators
#             8x narrower, gate/up and lm_head 121 -> 62 registers, twice the programs per
#             SM), with o / down in 2-row blocks, or only gate/up and lm_head folded
#   rows      decode.py at 32k, int4: GEMV tiles reading longer runs of each W row per
#             step (2-4 KiB, or whole 8 KiB rows for gate/up), folded to keep registers
#   combo     decode.py at 32k, int4: the row-run tiles of call 5 combined (o and down,
#             plus gate/up, plus qkv or lm_head with longer runs), down with whole rows
#   qkv       decode.py at 32k / 128k, int8 / int4: the qkv (RoPE) GEMV with longer runs
#             per W row (2 rows x 4 KiB or 4 x 2 KiB per step, folded), against the
#             defaults of the final call
#   final     GEMV / decoder / runner / argmax GPU tests with the new GEMV defaults, then
#             issue 4's benchmark at 32k / 64k / 128k, bf16 / int8 / int4, defaults vs
#             PDL off (pdl.on=0), side by side in one process
# Usage: OUT=$OUT bash benchmarks/h200_s13.sh prefetch   (results: $OUT/r/)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh  # $R, $XDIST, $R/gpu.txt, PYTHONPATH, gpu_tests, decode_variants
what=${1:?what}; shift
case $what in
prefetch)
  gpu_tests pdl-tests.log 150 tests/test_pdl_gpu.py tests/test_gemv.py -k "pdl or attention_stretch"
  decode_variants pf-int4 230 int4 ";pdl.first=3;pdl.first=2;attn.prefetch=2;attn.prefetch=8;attn.prefetch=2,pdl.first=3" --contexts 32k
  decode_variants pf-int8 200 int8 ";pdl.first=3;attn.prefetch=2;attn.prefetch=2,attn.pdl_launch=1" --contexts 32k
  ;;
bf16)
  decode_variants pf-bf16 200 bf16 ";pdl.first=3;attn.prefetch=2;attn.prefetch=2,attn.pdl_launch=1" --contexts 32k
  decode_variants path 240 bf16,int8,int4 ";pdl.on=0" --contexts 4k,32k
  ;;
argmax)
  gpu_tests tests.log 200 tests/test_argmax.py tests/test_pdl_gpu.py tests/test_runner.py \
    tests/test_gemv.py tests/test_kernels_swap_gpu.py
  decode_variants int4-4k-32k 200 int4 ";attn.pdl_launch=1;pdl.first=0" --contexts 4k,32k
  decode_variants int8-32k 100 int8 ";pdl.first=0" --contexts 32k
  ;;
fold)
  gpu_tests tests.log 120 tests/test_gemv.py tests/test_gemv_decoder.py
  decode_variants fold-int4 240 int4 ";gemv.fold=8;gemv.fold=4;gemv.fold=8,o.block_n=2,down.block_n=2;gate_up.fold=8,lm_head.fold=8" --contexts 32k
  decode_variants fold-int8 120 int8 ";gemv.fold=8" --contexts 32k
  ;;
rows)
  decode_variants rows-int4 240 int4 ";gate_up.block_n=1,gate_up.block_k=4096,gate_up.fold=8;gate_up.block_n=2,gate_up.block_k=2048,gate_up.fold=4;down.block_n=2,down.block_k=2048,down.fold=4;o.block_n=2,o.block_k=2048,o.fold=4" --contexts 32k
  ;;
combo)
  O="o.block_n=2,o.block_k=2048,o.fold=4"
  D="down.block_n=2,down.block_k=2048,down.fold=4"
  GU="gate_up.block_n=2,gate_up.block_k=2048,gate_up.fold=4"
  decode_variants combo-int4 240 int4 ";$O,$D;$O,$D,$GU;$O,$D,$GU,qkv.block_k=1024,qkv.fold=4;$O,$D,$GU,lm_head.block_n=4,lm_head.block_k=2048,lm_head.fold=4;$O,down.block_n=2,down.block_k=4096,down.fold=8" --contexts 32k
  ;;
qkv)
  decode_variants qkv 250 int8,int4 ";qkv.block_n=2,qkv.block_k=2048,qkv.fold=4;qkv.block_n=4,qkv.block_k=1024,qkv.fold=4" --contexts 32k,128k
  ;;
final)
  gpu_tests tests.log 90 tests/test_gemv.py tests/test_gemv_decoder.py tests/test_runner.py \
    tests/test_argmax.py
  timeout 420 python3 benchmarks/decode.py --contexts 32k,64k,128k --kv bf16,int8,int4 \
    --compile on --tokens 32 --warmup 4 --variants ";pdl.on=0" --out "$R/decode.json" \
    > "$R/decode.log" 2>&1
  grep -E "^\||^#" "$R/decode.log"
  ;;
*) echo "unknown case $what"; exit 2 ;;
esac
