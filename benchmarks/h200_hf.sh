#!/usr/bin/env bash
# Issue 5's comparison on the H200 in one device call: transformers' generate on a
# Llama-3.1-8B-shaped model (random bf16 weights), 32k prompt, 128 new tokens;
# DynamicCache vs kvtax int8/int4 vs QuantizedCache(quanto int4); eager and compiled.
#
#   device:  OUT=$OUT bash benchmarks/h200_hf.sh         (run's timeout_s 450, carry ["wheels"])
#   dry run: OUT=/tmp/hf-dry CONFIG=tiny CONTEXT=64 NEW_TOKENS=4 DEVICE=cpu MODES=eager,static \
#              bash benchmarks/h200_hf.sh
#   profile: PROFILE=1 OUT=$OUT bash benchmarks/h200_hf.sh   (run's timeout_s 300, no carry):
#            benchmarks/hf_profile.py instead: StaticCache vs kvtax int8, compiled
#            (reduce-overhead), a few decode steps under torch.profiler -> $OUT/profile/
#            summary.txt (ms/step, kernels and launches per step, top kernels, cudagraph
#            skips, recompiles); PROFILE_ARGS adds flags (e.g. "--arms static,kvtax-int8,
#            kvtax-int4 --trace"). Dry run: PROFILE=1 OUT=/tmp/p CONFIG=tiny CONTEXT=64
#            DEVICE=cpu PROFILE_ARGS="--backend aot_eager" bash benchmarks/h200_hf.sh
#
# wheels/ holds optimum_quanto-0.2.7-py3-none-any.whl (its needs: torch, ninja, numpy,
# safetensors, huggingface_hub are on the machine); it is installed into $SITE with no
# index. Rows run eager first (every arm), then compiled with CUDA graphs
# (reduce-overhead, transformers' default), then compiled without them; --budget-s skips
# rows that would likely end past BUDGET_S (they say so), and `timeout -s KILL HARD_S`
# is the backstop. Time (estimated): ~25 s setup (wheel, imports, 8B init), eager rows
# ~15-20 s each (32k prefill twice, 8 + 128 tokens at ~75 ms), compiled rows ~60-90 s each
# (compile in the warm-up); so eager x4 + reduce-overhead x3 end near 5.5 min and the
# compile-without-graphs rows run only if compiles were quicker. Every finished row is already fsynced in $OUT/hf/rows.jsonl; print its
# table here with `python benchmarks/hf_decode.py --table <files_at>/hf/rows.jsonl`.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
: "${OUT:?set OUT to the output folder}"

CONFIG=${CONFIG:-llama31-8b}
DEVICE=${DEVICE:-cuda}
CONTEXT=${CONTEXT:-32768}
NEW_TOKENS=${NEW_TOKENS:-128}
ARMS=${ARMS:-dynamic,kvtax-int8,kvtax-int4,quanto-int4}
MODES=${MODES:-eager,compiled}
COMPILE_MODES=${COMPILE_MODES:-reduce-overhead,default}
WARMUP_TOKENS=${WARMUP_TOKENS:-8}
BUDGET_S=${BUDGET_S:-330}
HARD_S=${HARD_S:-400}
SITE=${SITE:-/tmp/site}

export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export KVTAX_QUANTO_BUILD=${KVTAX_QUANTO_BUILD:-/tmp/kvtax-quanto}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
mkdir -p "$OUT"
if [[ ${PROFILE:-0} == 1 ]]; then
  t0=$SECONDS
  # shellcheck disable=SC2086  # PROFILE_ARGS is a list of flags
  timeout -s KILL "${PROFILE_HARD_S:-280}" python3 benchmarks/hf_profile.py --device "$DEVICE" \
    --config "$CONFIG" --context "$CONTEXT" --out "$OUT/profile" ${PROFILE_ARGS:-} \
    2>&1 | tee "$OUT/hf_profile.log"
  rc=${PIPESTATUS[0]}
  echo "[h200_hf] hf_profile.py ended after $((SECONDS - t0)) s (rc $rc)"
  exit "$rc"
fi
if ls "$ROOT"/wheels/*.whl >/dev/null 2>&1; then
  # Installed once per $SITE (a reinstall would drop quanto's extension builds there).
  [[ -f $SITE/.kvtax-wheels && $(cat "$SITE/.kvtax-wheels") == "$(ls "$ROOT"/wheels)" ]] ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$ROOT"/wheels/*.whl && ls "$ROOT"/wheels > "$SITE/.kvtax-wheels" \
    && export PYTHONPATH="$PYTHONPATH:$SITE" \
    || echo "[h200_hf] wheel install failed: the quanto rows will say unavailable"
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv > "$OUT/gpu.txt" 2>&1
fi
if [[ $DEVICE == cuda* ]] && [[ ,$ARMS, == *,quanto-int4,* ]]; then
  # Build quanto's unpack kernel (tens of seconds of nvcc) while the model is built and
  # the first arms run; the quanto row waits for it (a file lock) if it is not done.
  (python3 -c "from kvtax.harness.hf_quantized import prepare_quanto; print(prepare_quanto('cuda'))" \
    > "$OUT/quanto_build.log" 2>&1 &)
fi
t0=$SECONDS
timeout -s KILL "$HARD_S" python3 benchmarks/hf_decode.py --device "$DEVICE" --config "$CONFIG" \
  --context "$CONTEXT" --new-tokens "$NEW_TOKENS" --arms "$ARMS" --modes "$MODES" \
  --compile-modes "$COMPILE_MODES" --warmup-tokens "$WARMUP_TOKENS" --budget-s "$BUDGET_S" \
  --out "$OUT/hf" 2>&1 | tee "$OUT/hf_decode.log"
rc=${PIPESTATUS[0]}
echo "[h200_hf] hf_decode.py ended after $((SECONDS - t0)) s (rc $rc)"
if [[ $rc -ne 0 && -f $OUT/hf/rows.jsonl ]]; then  # killed: the table of the rows it finished
  python3 benchmarks/hf_decode.py --table "$OUT/hf/rows.jsonl" | tee "$OUT/hf/table.md"
fi
exit "$rc"
