#!/usr/bin/env bash
# Session 4's device calls, one per argument (what ran, for docs/BENCHMARKS.md):
#   1  decode-kernel variants at 128k (branch-free rescale, register caps, programs per
#      SM) with per-kernel times, read vs write L2 eviction, the HF first-generate profile
#   2  the runner's compiled decode step A/B at 32k; attention with the one-shot reduce and
#      the int8+hk rotation; the GPU kernel tests
#   3  the GPU kernel tests (xdist), attention with the one-GEMM rotation, issue 5's
#      compiled rows alone
#   4  issue 5's compiled rows with inductor's cudagraph_skip_dynamic_graphs on and off
# Usage: OUT=$OUT bash benchmarks/h200_s4.sh N   (results: $OUT/r.tgz)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh  # $R, $XDIST, $R/gpu.txt, PYTHONPATH
ATTN="python3 benchmarks/attention.py --phases decode --kernel-times"
case ${1:?call number} in
1)
  V="eager eager-sm9 eager-r192sm10 eager-r184sm11 eager-s2r184sm11 eager-n16r128sm16 eager-n16r168sm12"
  timeout 200 $ATTN --contexts 131072 --flush read --sweep --sweep-formats int8 int4 fp8 fp16 \
    --arms kvtax-fp16 kvtax-int8 kvtax-int4 kvtax-fp8 kvtax-int8hk sdpa-flash sdpa-cudnn \
    --sweep-variants $V sm4 --out "$R/attn-read" > "$R/attn-read.log" 2>&1
  TORCH_LOGS=recompiles,cudagraphs PROFILE=1 PROFILE_HARD_S=220 \
    PROFILE_ARGS="--first-generate 8 --arms kvtax-int8" OUT=$R bash benchmarks/h200_hf.sh > "$R/hf.log" 2>&1
  timeout 150 $ATTN --contexts 4096 32768 131072 --arms kvtax-fp16 kvtax-int8 kvtax-int4 \
    sdpa-cudnn --flush write --out "$R/attn-write" > "$R/attn-write.log" 2>&1 ;;
2)
  timeout 330 python3 benchmarks/decode.py --contexts 32k --kv bf16,int8,int4 --compile both \
    --tokens 32 --warmup 4 --profile 4 --out "$R/decode/decode.json" > "$R/decode.log" 2>&1
  timeout 90 $ATTN --contexts 32768 131072 --flush read --out "$R/attn" \
    --arms kvtax-fp16 kvtax-int8 kvtax-int4 kvtax-fp8 kvtax-int8hk sdpa-flash sdpa-cudnn \
    > "$R/attn.log" 2>&1
  timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels_gpu.py \
    tests/test_kernels_interp.py tests/test_kernels_lse_interp.py -rs > "$R/gpu-tests.log" 2>&1 ;;
3)
  XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n 12"
  timeout 200 python3 -m pytest -q -p no:cacheprovider $XDIST tests/test_kernels_gpu.py \
    tests/test_kernels_interp.py tests/test_kernels_lse_interp.py tests/test_rotation.py -rs \
    > "$R/gpu-tests.log" 2>&1
  timeout 60 $ATTN --contexts 131072 --flush read --out "$R/attn" \
    --arms kvtax-fp16 kvtax-int8 kvtax-int4 kvtax-int8hk sdpa-cudnn > "$R/attn.log" 2>&1
  ARMS=dynamic,kvtax-int8,kvtax-int4 MODES=compiled COMPILE_MODES=reduce-overhead BUDGET_S=280 \
    HARD_S=320 OUT=$R bash benchmarks/h200_hf.sh > "$R/hf.log" 2>&1 ;;
4)
  for skip in 1 0; do
    KVTAX_HF_SKIP_DYNAMIC=$skip TORCH_LOGS=recompiles,cudagraphs NEW_TOKENS=48 \
      ARMS=dynamic,kvtax-int8 MODES=compiled COMPILE_MODES=reduce-overhead BUDGET_S=250 \
      HARD_S=270 OUT=$R/skip$skip bash benchmarks/h200_hf.sh > "$R/hf-skip$skip.log" 2>&1
  done ;;
*) echo "unknown call $1" >&2; exit 2 ;;
esac
cd "$OUT" && tar czf r.tgz r && rm -rf r
