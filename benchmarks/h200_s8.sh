#!/usr/bin/env bash
# Session 8's device calls (what ran, for docs/BENCHMARKS.md and notes/KERNELS.md):
#   pdl    (ran at f25f1f0, the reverted PDL experiment: `git show f25f1f0:benchmarks/h200_s8.sh`)
#          the PDL GPU tests, then decode.py --pdl on,off at 32k/128k, bf16/int8/int4
#   ahead  decode_warp.py's QK-one-tile-ahead loop (`ahead`) against the default launch at
#          32k/128k, every format, side by side with cuDNN / flash; the kernel GPU tests
# Usage: OUT=$OUT bash benchmarks/h200_s8.sh ahead   (results: $OUT/r/)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh  # $R, $XDIST, $R/gpu.txt, PYTHONPATH
what=${1:?what}; shift
case $what in
ahead)
  timeout 200 python3 benchmarks/attention.py --phases decode --contexts 32768 131072 \
    --flush read --sweep --sweep-formats int8 int4 fp8 fp16 \
    --sweep-variants warp ah ah-s2 ah-n16 \
    --arms kvtax-fp16 kvtax-int8 kvtax-int4 kvtax-fp8 sdpa-cudnn sdpa-flash \
    --out "$R/attn" > "$R/attn.log" 2>&1
  grep -v "^\(decode\|prefill\) " "$R/attn.log" | tail -40
  cp "$R"/attn/*/rows.jsonl "$R/attn-rows.jsonl" 2>/dev/null
  timeout 200 python3 -m pytest -q -p no:cacheprovider $XDIST tests/test_kernels_gpu.py -rs \
    > "$R/kernel-tests.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$R/kernel-tests.log" | head; tail -2 "$R/kernel-tests.log" ;;
esac
ls -la "$R"
