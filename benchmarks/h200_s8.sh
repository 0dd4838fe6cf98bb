#!/usr/bin/env bash
# Session 8's device calls (what ran, for docs/BENCHMARKS.md and notes/KERNELS.md):
#   pdl    programmatic dependent launch (kvtax.pdl): the PDL / GEMV / runner / store GPU
#          tests, then the whole Llama-3.1-8B-shaped model at 32k/128k, compiled,
#          bf16/int8/int4, PDL on and off side by side (decode.py --pdl on,off), with the
#          in-model kernel profile; extra args go to decode.py
#   ahead  decode_warp.py's QK-one-tile-ahead loop (`ahead`) against the default launch at
#          32k/128k, every format, side by side with cuDNN / flash; the kernel GPU tests;
#          then a mutation check: the GEMV kernel with its pdl_wait removed must fail
#          tests/test_pdl.py (a race the test is there to catch)
# Usage: OUT=$OUT bash benchmarks/h200_s8.sh pdl|ahead [args]   (results: $OUT/r/)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?}"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv > "$R/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)" >> "$R/gpu.txt"
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n 12"
what=${1:?what}; shift
case $what in
pdl)
  timeout 200 python3 -m pytest -q -p no:cacheprovider $XDIST tests/test_pdl.py tests/test_gemv.py \
    tests/test_gemv_decoder.py tests/test_runner.py tests/test_runner_compile.py \
    tests/test_quantize_kernel.py tests/test_hf_graph_decode.py -rs > "$R/tests.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$R/tests.log" | head; tail -2 "$R/tests.log"
  timeout 380 python3 benchmarks/decode.py --contexts 32k,128k --kv bf16,int8,int4 --compile on \
    --tokens 32 --warmup 4 --profile 2 --pdl on,off --out "$R/decode.json" "$@" > "$R/decode.log" 2>&1
  grep -v Warn "$R/decode.log" | grep "ctx\|^|" | tail -16 ;;
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
  grep -E "^(FAILED|ERROR)" "$R/kernel-tests.log" | head; tail -2 "$R/kernel-tests.log"
  M=/tmp/kvtax-mutant; rm -rf "$M"; cp -r . "$M"
  sed -i 's/^    pdl_wait(PDL)$/    pass  # mutation: no wait/' "$M/src/kvtax/models/kernels/gemv.py"
  grep -c "mutation: no wait" "$M/src/kvtax/models/kernels/gemv.py"
  (cd "$M" && PYTHONPATH=$M/src timeout 120 python3 -m pytest -q -p no:cacheprovider \
    tests/test_pdl.py -k identical > "$R/mutant-tests.log" 2>&1)
  echo "mutant (expected to fail):"; tail -3 "$R/mutant-tests.log" ;;
esac
ls -la "$R"
