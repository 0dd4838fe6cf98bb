#!/usr/bin/env bash
# Session 6's device calls (what ran, for docs/BENCHMARKS.md and notes/KERNELS.md):
#   pattern  read_pattern.py at 128k (decode's access pattern with no arithmetic: codes
#            only vs the four metadata arrays vs merged layouts), then Nsight Compute on
#            the read-only twins (stall reasons with --print-details all)
#   ncu      Nsight Compute on one int8 and one int4 decode launch at 128k (call 1 ran
#            this part; its pattern part failed to compile on Triton 3.6: int8 dot)
#   strided  decode_warp.py with every S-th tile per split (the new default) vs one run
#            per split (`contig`), at 32k/128k, with the sweep variants; the GPU tests
#   packed   decode_packed.py (4 KV heads' query rows per MMA tile; the new int8/int4
#            default) vs decode_warp.py (`warp`) and its launch variants; the GPU tests
#   model    the whole Llama-3.1-8B-shaped model at 32k/128k, compiled, with the strided
#            decode_warp order (bf16, int8, int4)
#   clocks   the SM clock during whole-model decode at 128k (nvidia-smi every 200 ms) and
#            the in-model kernel times (--profile): is attention slower in the model
#            than standalone because the SM clock drops under sustained load?
#   aligned  the same whole-model run after storage.ALIGN (cache slots allocated in
#            multiples of 16, so the scale tensors' strides let Triton stage them), and
#            the runner / graph / cache tests on the GPU
#   variants decode_warp launch variants at 128k with the strided order (tile size,
#            programs per SM, pipeline stages)
#   stages   two pipeline stages vs three (the default) for the int8, fp8, int4 decode at
#            128k, twice in one call
# Usage: OUT=$OUT bash benchmarks/h200_s6.sh pattern [quick]|ncu|strided|packed|model|clocks|aligned|variants|stages   (results: $OUT/r/)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh  # $R, $XDIST, $R/gpu.txt, PYTHONPATH
NCU="ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SourceCounters --section Occupancy --print-details all"
case ${1:?what} in
pattern)
  timeout 150 python3 benchmarks/read_pattern.py --context 131072 --rows 128 64 256 \
    --per-sm 8 4 --order contiguous strided --out "$R/pattern.jsonl" 2>&1 | tee "$R/pattern.log"
  [ "${2:-}" = quick ] && exit 0
  for layout in codes split; do
    timeout 60 $NCU --kernel-name regex:^_read_kernel --launch-skip 2 --launch-count 1 \
      python3 benchmarks/read_pattern.py --context 131072 --rows 128 --layouts $layout --reps 3 \
      > "$R/ncu-pattern-$layout.txt" 2>&1
  done ;;
strided)
  timeout 200 python3 benchmarks/attention.py --phases decode --kernel-times --contexts 32768 131072 \
    --flush read --sweep --sweep-formats int8 int4 fp8 fp16 --sweep-variants contig sm4 contig-sm4 n64sm4 \
    --arms kvtax-fp16 kvtax-int8 kvtax-int4 kvtax-fp8 kvtax-int8hk sdpa-cudnn \
    --out "$R/attn" > "$R/attn.log" 2>&1
  XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n 12"
  timeout 200 python3 -m pytest -q -p no:cacheprovider $XDIST tests/test_kernels_gpu.py \
    tests/test_kernels_interp.py tests/test_kernels_lse_interp.py -rs > "$R/gpu-tests.log" 2>&1
  tail -3 "$R/gpu-tests.log"; grep -v "^\(decode\|prefill\) " "$R/attn.log" | tail -40 ;;
packed)
  timeout 200 python3 benchmarks/attention.py --phases decode --kernel-times --contexts 32768 131072 \
    --flush read --sweep --sweep-formats int8 int4 --sweep-variants warp p-hp2 p-n32 p-s3 p-sm4 p-sm12 \
    --arms kvtax-fp16 kvtax-int8 kvtax-int4 kvtax-fp8 kvtax-int8hk sdpa-cudnn \
    --out "$R/attn" > "$R/attn.log" 2>&1
  XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n 12"
  timeout 200 python3 -m pytest -q -p no:cacheprovider $XDIST tests/test_kernels_gpu.py \
    tests/test_kernels_interp.py tests/test_kernels_lse_interp.py -rs > "$R/gpu-tests.log" 2>&1
  tail -3 "$R/gpu-tests.log"; grep -v "^\(decode\|prefill\) " "$R/attn.log" | tail -40
  cp "$R"/attn/*/rows.jsonl "$R/attn-rows.jsonl" 2>/dev/null ;;
model)
  timeout 420 python3 benchmarks/decode.py --contexts 32k,128k --kv bf16,int8,int4 \
    --compile on --tokens 32 --warmup 4 --out "$R/decode.json" > "$R/decode.log" 2>&1
  tail -30 "$R/decode.log" ;;
clocks)
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active \
    --format=csv -lms 200 > "$R/clocks.csv" 2>&1 &
  SMI=$!
  timeout 240 python3 benchmarks/decode.py --contexts 128k --kv bf16,int8 --compile on \
    --tokens 48 --warmup 4 --profile 4 --out "$R/decode-profile.json" > "$R/decode.log" 2>&1
  kill $SMI; tail -12 "$R/decode.log"
  python3 - "$R/clocks.csv" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))[1:]
sm = [int(r[1].split()[0]) for r in rows if len(r) > 4 and r[1].strip()[0].isdigit()]
print("samples", len(sm), "sm MHz min/median/max", min(sm), sorted(sm)[len(sm)//2], max(sm))
print(collections.Counter(r[4].strip() for r in rows if len(r) > 4).most_common(5))
PY
  ;;
aligned)
  timeout 330 python3 benchmarks/decode.py --contexts 32k,128k --kv bf16,int8,int4 --compile on \
    --tokens 32 --warmup 4 --profile 2 --out "$R/decode-aligned.json" > "$R/decode.log" 2>&1
  grep -v Warn "$R/decode.log" | grep "ctx\|^|" | tail -12
  timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_runner.py \
    tests/test_runner_compile.py tests/test_hf_graph_decode.py tests/test_cache.py -rs \
    > "$R/runner-tests.log" 2>&1; tail -3 "$R/runner-tests.log" ;;
variants)
  timeout 150 python3 benchmarks/attention.py --phases decode --contexts 131072 --flush read \
    --sweep --sweep-formats int8 int4 --sweep-variants warp n64 n64sm4 sm6 s2 n16 \
    --arms kvtax-int8 kvtax-int4 sdpa-cudnn --out "$R/attn" > "$R/attn.log" 2>&1
  grep -v "^\(decode\|prefill\) " "$R/attn.log" | tail -22 ;;
stages)
  for i in 1 2; do
    timeout 100 python3 benchmarks/attention.py --phases decode --contexts 131072 --flush read \
      --reps 40 --sweep --sweep-formats int8 fp8 int4 --sweep-variants warp s2 \
      --arms kvtax-int8 sdpa-cudnn --out "$R/attn$i" > "$R/attn$i.log" 2>&1
    grep "@" "$R/attn$i.log" | grep -v "^\(decode\|prefill\) "
  done ;;
ncu)
  for kv in int8 int4; do
    timeout 90 $NCU --kernel-name regex:_decode_warp --launch-skip 2 --launch-count 1 \
      python3 benchmarks/ncu_decode.py --kv $kv > "$R/ncu-decode-$kv.txt" 2>&1
  done ;;
esac
ls -la "$R"
