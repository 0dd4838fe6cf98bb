#!/usr/bin/env bash
# Session 7's device calls (what ran, for docs/BENCHMARKS.md and notes/KERNELS.md):
#   subs   decode_warp.py's sub-streams (row blocks of the 16-row MMA tile scoring
#          different sub-tiles, `sub_streams`) against the default launch at 32k/128k,
#          every format, side by side with cuDNN / flash; then the kernel GPU tests
#   model  the whole Llama-3.1-8B-shaped model at 32k/128k, compiled, bf16/int8/int4,
#          with the in-model kernel profile; extra args go to decode.py
#   gemv   benchmarks/gemv.py: the Triton GEMV (fused norm / SiLU-mul / residual) vs
#          cuBLAS on the model's decode shapes, with its config sweep
#   round2 the store kernel's launch variants (quantize.py --launches), 4-5 pipeline
#          stages for decode at 128k, the GEMV sweep, then the whole model at 32k with
#          the torch linears vs the fused Triton GEMVs (decode.py --gemv), the gemv tests
#   final  the whole model at 32k/128k, torch linears vs fused GEMVs (unsplit GEMV configs,
#          one-row store launches), then the GEMV, runner, graph, store and cache tests
# Usage: OUT=$OUT bash benchmarks/h200_s7.sh subs|model|gemv [args]   (results: $OUT/r/)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh  # $R, $XDIST, $R/gpu.txt, PYTHONPATH
what=${1:?what}; shift
case $what in
subs)
  timeout 240 python3 benchmarks/attention.py --phases decode --contexts 32768 131072 \
    --flush read --sweep --sweep-formats int8 int4 fp8 fp16 \
    --sweep-variants warp s2 ss2 ss2-st2 ss4 ss4-st2 ss4-sm4 ss4-sm6-st2 ss2n32 ss2n32-st2 ss4n32-st2 \
    --arms kvtax-fp16 kvtax-int8 kvtax-int4 kvtax-fp8 sdpa-cudnn sdpa-flash \
    --out "$R/attn" > "$R/attn.log" 2>&1
  grep -v "^\(decode\|prefill\) " "$R/attn.log" | tail -60
  cp "$R"/attn/*/rows.jsonl "$R/attn-rows.jsonl" 2>/dev/null
  timeout 240 python3 -m pytest -q -p no:cacheprovider $XDIST tests/test_kernels_gpu.py \
    tests/test_kernels_interp.py tests/test_kernels_lse_interp.py -rs > "$R/gpu-tests.log" 2>&1
  tail -3 "$R/gpu-tests.log" ;;
model)
  timeout 400 python3 benchmarks/decode.py --contexts 32k,128k --kv bf16,int8,int4 --compile on \
    --tokens 32 --warmup 4 --profile 2 --out "$R/decode.json" "$@" > "$R/decode.log" 2>&1
  grep -v Warn "$R/decode.log" | grep "ctx\|^|" | tail -12 ;;
gemv)
  timeout 240 python3 benchmarks/gemv.py --sweep --out "$R/gemv" "$@" > "$R/gemv.log" 2>&1
  tail -60 "$R/gemv.log" ;;
round2)
  timeout 60 python3 benchmarks/quantize.py --formats int8 int4 fp16 --chunk 0 --reps 100 \
    --launches fused-r1w1 fused-r2w1 fused-r1w4 fused-r8w1 --out "$R/quantize" > "$R/quantize.log" 2>&1
  grep "^|" "$R/quantize.log"
  timeout 70 python3 benchmarks/attention.py --phases decode --contexts 131072 --flush read \
    --sweep --sweep-formats int8 int4 fp8 --sweep-variants warp s2 s4 s5 \
    --arms kvtax-int8 kvtax-int4 sdpa-cudnn --out "$R/attn" > "$R/attn.log" 2>&1
  grep "@\|kvtax-int\|cudnn" "$R/attn.log" | grep -v "^\(decode\|prefill\) " | tail -16
  cp "$R"/attn/*/rows.jsonl "$R/attn-rows.jsonl" 2>/dev/null
  timeout 60 python3 -m pytest -q -p no:cacheprovider $XDIST tests/test_gemv.py tests/test_gemv_decoder.py \
    > "$R/gemv-tests.log" 2>&1; tail -2 "$R/gemv-tests.log"
  timeout 130 python3 benchmarks/gemv.py --sweep --budget-s 100 --out "$R/gemv" > "$R/gemv.log" 2>&1
  tail -45 "$R/gemv.log"
  for g in torch triton; do
    timeout 150 python3 benchmarks/decode.py --contexts 32k --kv bf16,int8,int4 --compile on \
      --tokens 32 --warmup 4 --profile 2 --gemv $g --out "$R/decode-$g.json" > "$R/decode-$g.log" 2>&1
    grep -v Warn "$R/decode-$g.log" | grep "ctx\|^|" | tail -8
  done ;;
final)
  timeout 220 python3 benchmarks/decode.py --contexts 32k,128k --kv bf16,int8,int4 --compile on \
    --tokens 32 --warmup 4 --profile 2 --gemv triton --out "$R/decode-triton.json" > "$R/decode-triton.log" 2>&1
  grep -v Warn "$R/decode-triton.log" | grep "ctx\|^|" | tail -8
  timeout 150 python3 -m pytest -q -p no:cacheprovider $XDIST tests/test_gemv.py tests/test_gemv_decoder.py \
    tests/test_runner.py tests/test_runner_compile.py tests/test_hf_graph_decode.py \
    tests/test_quantize_kernel.py tests/test_cache.py -rs > "$R/tests.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$R/tests.log" | head; tail -2 "$R/tests.log"
  timeout 190 python3 benchmarks/decode.py --contexts 32k,128k --kv bf16,int8,int4 --compile on \
    --tokens 32 --warmup 4 --gemv torch --out "$R/decode-torch.json" > "$R/decode-torch.log" 2>&1
  grep -v Warn "$R/decode-torch.log" | grep "ctx\|^|" | tail -8 ;;
esac
ls -la "$R"
