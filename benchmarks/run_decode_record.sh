#!/usr/bin/env bash
# The whole-model decode run of record (docs/BENCHMARKS.md, "Whole-model decode"):
# Llama-3.1-8B shapes with random bf16 weights, batch 1, the compiled decode step replayed
# from a CUDA graph (greedy, one replay per token), 32 timed steps after 4 warm-up, at
# 32k / 64k / 128k context with bf16 / int8 / int4 KV; each cell's ms/token against the
# bytes roofline (weight + KV bytes over the best read rate measured in the same process).
# One CUDA GPU with >= 40 GB, ~4 min on an H200.
#
#   bash benchmarks/run_decode_record.sh [OUT_JSON] [more decode.py args]
#
# OUT_JSON (default runs/decode-record.json) gets the rows and run metadata (command, GPU,
# versions, commit, read rates). Extra arguments go to decode.py: `--profile 2` adds the
# step's critical path by kernel role, `--variants ";o.block_k=1024"` times a GEMV launch
# override beside the defaults. PDL off: run again with KVTAX_PDL=0 in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/decode-record.json}
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$(dirname "$out")"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python benchmarks/decode.py --contexts 32k,64k,128k --kv bf16,int8,int4 --compile on \
  --tokens 32 --warmup 4 --out "$out" "$@"
