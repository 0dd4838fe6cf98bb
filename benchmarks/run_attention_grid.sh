#!/usr/bin/env bash
# The attention benchmark of record (docs/BENCHMARKS.md, "Attention kernels"): one
# Llama-3.1-8B layer (32 q heads, 8 KV heads, head_dim 128, batch 1), every arm (kvtax
# fp16 / int8 / int4 / fp8, SDPA flash and cuDNN, dequantize-then-SDPA, scores
# materialized), decode (1 row) and a 2048-row prefill chunk at 4k / 16k / 64k / 128k,
# median of 20 CUDA-graph replays with L2 evicted before each. One CUDA GPU, ~5 min on an H200.
#
#   bash benchmarks/run_attention_grid.sh [OUT_DIR] [more attention.py args]
#
# OUT_DIR (default runs/attention-grid) receives <timestamp>/ with config.json (command,
# GPU, versions, commit, read ceiling), rows.jsonl, rows.csv and summary.md; the summary
# is printed last. Extra arguments go to attention.py (e.g. --flush write).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/attention-grid}
shift $(( $# > 0 ? 1 : 0 ))
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python benchmarks/attention.py --contexts 4096 16384 65536 131072 --reps 20 --out "$out" "$@"
