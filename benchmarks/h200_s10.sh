#!/usr/bin/env bash
# Session 10's device calls (what ran, for docs/BENCHMARKS.md and notes/KERNELS.md):
#   steps  the swapped kernels' GPU tests (lazy rescaling now the default; 64-slot steps),
#          then attention.py decode at 32k / 128k: int8 / int4 / cuDNN side by side and the
#          swap sweep (eager, 64-slot steps at 8 / 10 / 12 programs per SM)
#   runner decode.py at 32k, bf16 / int8 / int4, compiled step in a CUDA graph, with a
#          per-kernel profile of 2 steps (where the step's time goes)
#   rope   the GEMV / decoder / runner GPU tests, then `runner` at 32k and 128k (the qkv
#          GEMV's RoPE epilogue)
#   final  the attention kernels' GPU tests (full grid + swapped kernels), then issue 3's
#          benchmark: every arm, decode and a 2048-row prefill chunk, 4k / 16k / 64k / 128k
#   whole  `rope`'s decode.py run again (roofline over the best read rate of the run)
#   whole2 the GEMV / decoder GPU tests, then `whole` (the new GEMV default launches)
#   gemv   decode.py at 32k int8 with the per-projection GEMV profile, the default GEMV
#          launches and three whole-model variants (--gemv-override); GEMV_VARIANTS
#          replaces the variant list (space-separated, "" = the default)
# Usage: OUT=$OUT bash benchmarks/h200_s10.sh steps   (results: $OUT/r/)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh  # $R, $XDIST, $R/gpu.txt, PYTHONPATH
what=${1:?what}; shift
whole_model() {  # whole_model SECONDS: decode.py at 32k / 128k, bf16 / int8 / int4, profiled
  timeout "$1" python3 benchmarks/decode.py --contexts 32k,128k --kv bf16,int8,int4 \
    --compile on --tokens 32 --warmup 4 --profile 2 --out "$R/decode.json" \
    > "$R/decode.log" 2>&1
  grep -v Warning "$R/decode.log" | tail -16
}
case $what in
steps)
  gpu_tests swap-tests.log 150 tests/test_kernels_swap_gpu.py tests/test_kernels_swap.py
  timeout 200 python3 benchmarks/attention.py --phases decode --contexts 32768 131072 \
    --sweep --sweep-formats int8 int4 --reps 20 \
    --sweep-variants swap swap-eager swap-sm12 swap-n64 swap-n64-sm10 swap-n64-sm12 \
    --arms kvtax-int8 kvtax-int4 sdpa-cudnn --out "$R/attn" > "$R/attn.log" 2>&1
  grep -v "^\(decode\|prefill\) " "$R/attn.log" | tail -40
  cp "$R"/attn/*/rows.jsonl "$R/attn-rows.jsonl" 2>/dev/null ;;
runner)
  timeout "${RUNNER_S:-400}" python3 benchmarks/decode.py --contexts 32k --kv "${KV:-bf16,int8,int4}" \
    --compile on --tokens 32 --warmup 4 --profile 2 --out "$R/decode.json" "$@" \
    > "$R/decode.log" 2>&1
  tail -60 "$R/decode.log" ;;
rope)
  gpu_tests rope-tests.log 200 tests/test_gemv.py tests/test_gemv_decoder.py \
    tests/test_runner.py tests/test_runner_compile.py
  whole_model 330 ;;
final)
  gpu_tests kernel-tests.log 170 tests/test_kernels_gpu.py tests/test_kernels_swap_gpu.py \
    tests/test_kernels_swap.py
  timeout 380 python3 benchmarks/attention.py --contexts 4096 16384 65536 131072 --reps 20 \
    --out "$R/attn" > "$R/attn.log" 2>&1
  echo "attention.py exit $?"
  grep -v "^\(decode\|prefill\) " "$R/attn.log" | tail -60
  cp "$R"/attn/*/rows.jsonl "$R/attn-rows.jsonl" 2>/dev/null
  cp "$R"/attn/*/summary.md "$R/attn-summary.md" 2>/dev/null ;;
whole)
  whole_model 400 ;;
whole2)
  gpu_tests gemv-tests.log 120 tests/test_gemv.py tests/test_gemv_decoder.py
  whole_model 400 ;;
gemv)
  for v in ${GEMV_VARIANTS:-"" num_stages=2 num_stages=3 num_warps=8}; do
    tag=${v:-default}; tag=${tag//=/-}
    timeout 120 python3 benchmarks/decode.py --contexts 32k --kv int8 --compile on --tokens 32 \
      --warmup 4 --profile 2 --gemv-override "$v" --out "$R/decode-$tag.json" \
      > "$R/decode-$tag.log" 2>&1
    echo "== $tag"; grep -E "^ctx" "$R/decode-$tag.log"
  done ;;
esac
ls -la "$R"
