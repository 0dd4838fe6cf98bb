#!/usr/bin/env bash
# Session 11's device calls (what ran, for docs/BENCHMARKS.md and notes/KERNELS.md):
#   explore decode.py at 32k with launch variants in one process (benchmarks/variants.py):
#           per-projection GEMV tiles and warps, decode-attention programs per SM; each
#           cell profiled (GEMV µs per projection, attention ms per step)
# Usage: OUT=$OUT bash benchmarks/h200_s11.sh explore   (results: $OUT/r/)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh  # $R, $XDIST, $R/gpu.txt, PYTHONPATH
what=${1:?what}; shift
decode_variants() {  # decode_variants TAG SECONDS KV VARIANTS [decode.py args...]
  local tag=$1 secs=$2 kv=$3 vs=$4; shift 4
  timeout "$secs" python3 benchmarks/decode.py --kv "$kv" --compile on --tokens 32 \
    --warmup 4 --profile 2 --variants "$vs" --out "$R/$tag.json" "$@" > "$R/$tag.log" 2>&1
  echo "== $tag"; grep -E "^ctx|^#|Error" "$R/$tag.log" | cut -c1-400
}
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
*) echo "unknown case $what"; exit 2 ;;
esac
