#!/usr/bin/env bash
# The transformers comparison of record (docs/BENCHMARKS.md, "Inside Hugging Face
# transformers"): `model.generate` on a Llama-3.1-8B-shaped transformers model (random bf16
# weights), 32k prompt, 128 new tokens; kvtax int8 / int4 against DynamicCache eager,
# StaticCache compiled (reduce-overhead) and quanto's int4 QuantizedCache eager. Each row
# warms up with an 8-token generate on the same cache. One CUDA GPU, ~6 min on an H200.
#
#   bash benchmarks/run_hf_record.sh [OUT_DIR]            (default runs/hf-record)
#   dry run on CPU: CONFIG=tiny CONTEXT=64 NEW_TOKENS=4 DEVICE=cpu MODES=eager,static \
#                   bash benchmarks/run_hf_record.sh /tmp/hf-dry
#   profile: PROFILE=1 bash benchmarks/run_hf_record.sh  -> benchmarks/hf_profile.py:
#            StaticCache vs kvtax int8 compiled (reduce-overhead), a few decode steps of one
#            generate under torch.profiler -> OUT_DIR/profile/summary.txt (ms per step,
#            kernels and launches per step, top kernels, cudagraph skips, recompiles);
#            PROFILE_ARGS adds flags ("--first-generate 8" resets the cache after a short
#            generate first, as hf_decode.py does). CPU: add DEVICE=cpu CONFIG=tiny
#            CONTEXT=64 PROFILE_ARGS="--backend aot_eager".
#
# The QuantizedCache rows need optimum-quanto (`pip install optimum-quanto==0.2.7`; without
# it they say unavailable); its CUDA unpack kernel is built alone (nvcc, in the background
# while the first rows run) rather than quanto's whole extension. Rows that would likely end
# past BUDGET_S seconds are skipped and say so; HARD_S kills the run. Every finished row is
# fsynced to OUT_DIR/hf/rows.jsonl; `python benchmarks/hf_decode.py --table
# OUT_DIR/hf/rows.jsonl` prints the table of a cut-short run.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${1:-runs/hf-record}

CONFIG=${CONFIG:-llama31-8b}
DEVICE=${DEVICE:-cuda}
CONTEXT=${CONTEXT:-32768}
NEW_TOKENS=${NEW_TOKENS:-128}
ARMS=${ARMS:-dynamic,kvtax-int8,kvtax-int4,quanto-int4}
MODES=${MODES:-compiled,eager}
COMPILE_MODES=${COMPILE_MODES:-reduce-overhead}
WARMUP_TOKENS=${WARMUP_TOKENS:-8}
BUDGET_S=${BUDGET_S:-370}
HARD_S=${HARD_S:-430}

export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export KVTAX_QUANTO_BUILD=${KVTAX_QUANTO_BUILD:-/tmp/kvtax-quanto}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
mkdir -p "$OUT_DIR"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv > "$OUT_DIR/gpu.txt" 2>&1
fi
if [[ ${PROFILE:-0} == 1 ]]; then
  # shellcheck disable=SC2086  # PROFILE_ARGS is a list of flags
  timeout -s KILL "${PROFILE_HARD_S:-280}" python3 benchmarks/hf_profile.py --device "$DEVICE" \
    --config "$CONFIG" --context "$CONTEXT" --out "$OUT_DIR/profile" ${PROFILE_ARGS:-} \
    2>&1 | tee "$OUT_DIR/hf_profile.log"
  exit "${PIPESTATUS[0]}"
fi
if [[ $DEVICE == cuda* ]] && [[ ,$ARMS, == *,quanto-int4,* ]]; then
  # the quanto row waits for this build (a file lock) if it is not done when it starts
  (python3 -c "from kvtax.harness.bench.hf_quantized import prepare_quanto; print(prepare_quanto('cuda'))" \
    > "$OUT_DIR/quanto_build.log" 2>&1 &)
fi
t0=$SECONDS
timeout -s KILL "$HARD_S" python3 benchmarks/hf_decode.py --device "$DEVICE" --config "$CONFIG" \
  --context "$CONTEXT" --new-tokens "$NEW_TOKENS" --arms "$ARMS" --modes "$MODES" \
  --compile-modes "$COMPILE_MODES" --warmup-tokens "$WARMUP_TOKENS" --budget-s "$BUDGET_S" \
  --out "$OUT_DIR/hf" 2>&1 | tee "$OUT_DIR/hf_decode.log"
rc=${PIPESTATUS[0]}
echo "hf_decode.py ended after $((SECONDS - t0)) s (exit $rc)" >&2
if [[ $rc -ne 0 && -f $OUT_DIR/hf/rows.jsonl ]]; then  # killed: the table of the rows it finished
  python3 benchmarks/hf_decode.py --table "$OUT_DIR/hf/rows.jsonl" | tee "$OUT_DIR/hf/table.md"
fi
exit "$rc"
