#!/usr/bin/env bash
# Session 11's device calls (what ran, for docs/BENCHMARKS.md and notes/KERNELS.md):
#   explore decode.py at 32k with launch variants in one process (benchmarks/variants.py):
#           per-projection GEMV tiles and warps, decode-attention programs per SM; each
#           cell profiled (GEMV µs per projection, attention ms per step)
#   prefetch (at 1bce831, reverted in 21ea194) the GEMV / decoder / prefetch GPU tests, then
#           decode.py with the GEMVs' L2 prefetch of the next weight off (budget 0) and at
#           4 / 8 (default) / 16 MiB, 32k int8 / int4 and 128k int4
#   record  kernel_floor.py (one streaming read per decode-step size, alone and as the 128-
#           kernel chain of the layers' GEMV reads), then issue 4's benchmark: decode.py at
#           4k / 16k / 32k / 64k / 128k, bf16 / int8 / int4, profiled
#   pdl     kernel_floor.py with the chain under programmatic dependent launch (wait and
#           trigger placements): what a kernel boundary costs with PDL
#   gemvpdl the GEMV / decoder GPU tests, then decode.py with the GEMVs launched with and
#           without PDL (pdl.on=0 / default), 32k bf16 / int8 / int4 and 128k int4
#   pdlwait decode.py, GEMV PDL off / waiting first thing / waiting after the first W tile
#   final   the GEMV / decoder / runner GPU tests with the new default (PDL, wait first
#           thing), then decode.py at 32k / 64k / 128k, bf16 / int8 / int4, profiled
# Usage: OUT=$OUT bash benchmarks/h200_s11.sh explore   (results: $OUT/r/)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh  # $R, $XDIST, $R/gpu.txt, PYTHONPATH
what=${1:?what}; shift
# one variant per probe: every projection changed at once (the profile times each apart)
G1="qkv.num_warps=8,qkv.block_k=1024,o.block_k=1024,down.block_k=1024,gate_up.num_warps=8"
G2="qkv.block_n=4,qkv.block_k=1024,o.block_n=2,o.block_k=1024,down.block_n=2,down.block_k=2048,gate_up.block_n=2,gate_up.block_k=2048"
G3="qkv.num_warps=2,o.num_warps=2,down.block_n=8,gate_up.block_k=512"
G4="qkv.block_n=16,qkv.num_warps=8,o.block_n=8,o.block_k=1024,o.num_warps=8,down.block_k=1024,down.num_warps=8,gate_up.block_n=8,gate_up.num_warps=8"
case $what in
explore)
  decode_variants explore-int8 330 int8 ";$G1,attn.per_sm=6;$G2,attn.per_sm=12;$G3,attn.per_sm=10;$G4,attn.per_sm=4" --contexts 32k
  decode_variants explore-int4 200 int4,bf16 ";attn.per_sm=8;attn.per_sm=16" --contexts 32k
  ;;
record)
  timeout 120 python3 benchmarks/kernel_floor.py --out "$R/floor.json" > "$R/floor.log" 2>&1
  grep -v Warning "$R/floor.log" | tail -8
  timeout 420 python3 benchmarks/decode.py --contexts 4k,16k,32k,64k,128k --kv bf16,int8,int4 \
    --compile on --tokens 32 --warmup 4 --profile 2 --out "$R/decode.json" > "$R/decode.log" 2>&1
  grep -E "^\|" "$R/decode.log"; grep -E "^ctx" "$R/decode.log" | cut -c1-330
  ;;
pdl)
  timeout 300 python3 benchmarks/kernel_floor.py --out "$R/floor-pdl.json" > "$R/floor-pdl.log" 2>&1
  grep -v Warning "$R/floor-pdl.log" | tail -16
  ;;
gemvpdl)
  gpu_tests gemv-tests.log 150 tests/test_gemv.py tests/test_gemv_decoder.py tests/test_runner.py
  decode_variants pdl-32k 300 bf16,int8,int4 "pdl.on=0;" --contexts 32k
  decode_variants pdl-128k 150 int4 "pdl.on=0;" --contexts 128k
  ;;
pdlwait)
  decode_variants pdlwait-32k 300 int8,int4 "pdl.on=0;pdl.first=0;" --contexts 32k
  ;;
final)
  gpu_tests gemv-tests.log 100 tests/test_gemv.py tests/test_gemv_decoder.py tests/test_runner.py
  timeout 300 python3 benchmarks/decode.py --contexts 32k,64k,128k --kv bf16,int8,int4 \
    --compile on --tokens 32 --warmup 4 --profile 2 --out "$R/decode.json" > "$R/decode.log" 2>&1
  grep -E "^\|" "$R/decode.log"; grep -E "^ctx" "$R/decode.log" | cut -c1-200
  ;;
*) echo "unknown case $what"; exit 2 ;;
esac
