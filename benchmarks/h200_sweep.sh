#!/usr/bin/env bash
# Issue 6's full sweep on the H200, split over two device calls, then the report here.
#
#   device, call 1 and call 2: the same command; call 2 resumes the run that call 1 left
#   (found under $RUNS_DIR, which the lead carries back in):
#       OUT=$OUT bash benchmarks/h200_sweep.sh            (run's timeout_s 560)
#       call 1 carry: ["wheels"]
#       call 2 carry: ["wheels", "runs/h200-sweep"]
#   here, after each call (files_at = the folder the call's files were copied to):
#       bash benchmarks/h200_sweep.sh collect <files_at>  # -> runs/h200-sweep/<run>/ + logs
#   here, once both calls are in:
#       bash benchmarks/h200_sweep.sh report              # report.md + figures/ in the run
#   here, to prove the whole flow on CPU (tiny model, two calls cut by the budget, report):
#       bash benchmarks/h200_sweep.sh dry-run
#
# Every cell runs in a fresh process; rows are fsynced one by one into $OUT/<run>/rows.jsonl,
# so a call killed at its limit keeps every finished row, and the resume runs exactly the
# cells without one. `--budget-s` stops starting cells that would likely end past BUDGET_S;
# `timeout -s KILL HARD_S` is the backstop (the cell in flight then has no row and reruns).
# Cells order rep by rep (--rounds): a call cut short still holds whole repetitions.
# Some baselines stop early (--max-context; those cells are rows with status "skipped" and
# the reason): the unfused (score-materializing) path at 64k for int4 and 32k for int8 (its
# 128k prefill needs ~70 GB of scores and ~1 min a cell), the dequantize-everything path at
# 64k for int8 (int4 goes to 128k), transformers' QuantizedCache at 32k (eager HF with a
# fresh transformers import per cell; issue 5's comparison is at 32k).
# An arm that runs out of memory or time is not retried at that context or above
# (--skip-after-failure); a hung cell is killed after CELL_TIMEOUT s (status "timeout").
#
# Time (estimated from the 2026-11-29 H200 runs: ~2 s per cell of process + model setup,
# prefill at ~480 TFLOP/s fp16 / ~290 int8-int4 attention, decode 7-15 ms graph, eager
# baselines more): ~330 s of cells per repetition (4k 36, 16k 44, 32k 62, 64k 79, 128k 108)
# + ~80 s of warm-up cells, so ~1070 s for 3 repetitions. Two calls at BUDGET_S=460 hold
# repetitions 1-2 and about half of the third; a third call (same command and carry) ends
# it in ~3 min. Each call ends within HARD_S=520 s (+ a few s of setup).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

MODEL=${MODEL:-llama-3.1-8b}
DEVICE=${DEVICE:-cuda}
CONTEXTS=${CONTEXTS:-4k,16k,32k,64k,128k}
KV=${KV:-fp16,int8,int4}
PATHS=${PATHS:-fused,fp16,unfused,dequant,hf-quantized}
REPS=${REPS:-3}
WARMUP=${WARMUP:-1}
DECODE_TOKENS=${DECODE_TOKENS:-32}
CELL_TIMEOUT=${CELL_TIMEOUT:-100}
MAX_CONTEXT=${MAX_CONTEXT:-int8/unfused=32k,unfused=64k,int8/dequant=64k,hf-quantized=32k}
BUDGET_S=${BUDGET_S:-460}     # start no cell likely to end later than this (seconds)
HARD_S=${HARD_S:-520}         # kill the sweep here whatever it is doing
RUNS_DIR=${RUNS_DIR:-runs/h200-sweep}
NAME=${NAME:-h200-sweep}
CLAIMS=${CLAIMS:-benchmarks/h200_claims.json}
SITE=${SITE:-/tmp/site}

say() { echo "[h200_sweep] $*"; }

setup_env() {
  export PYTHONUNBUFFERED=1
  export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
  if ls "$ROOT"/wheels/*.whl >/dev/null 2>&1; then
    # Installed once per $SITE (a reinstall would drop quanto's extension builds there).
    [[ -f $SITE/.kvtax-wheels && $(cat "$SITE/.kvtax-wheels") == "$(ls "$ROOT"/wheels)" ]] ||
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$ROOT"/wheels/*.whl && ls "$ROOT"/wheels > "$SITE/.kvtax-wheels" \
      && export PYTHONPATH="$PYTHONPATH:$SITE" \
      || say "wheel install failed: hf-quantized rows will say unavailable"
  fi
  # quanto's unpack kernel is built once per machine, in the background while cells run.
  export KVTAX_QUANTO_BUILD=${KVTAX_QUANTO_BUILD:-/tmp/kvtax-quanto}
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
}

run_rows() {  # rows / planned cells of a run folder
  python3 - "$1" <<'EOF'
import sys
from kvtax.harness.plan import SweepConfig, plan_cells
from kvtax.harness.store import RunStore
store = RunStore.open(sys.argv[1])
ids = [c.cell_id for c in plan_cells(SweepConfig.from_dict(store.config()))]
rows = [r["cell_id"] for r in store.rows()]
done = set(rows) & set(ids)
dup = len(rows) - len(set(rows))
print(f"{store.path.name}: {len(done)}/{len(ids)} cells have rows, {len(ids) - len(done)} left,"
      f" {dup} duplicate rows")
EOF
}

device_run() {
  : "${OUT:?set OUT to the output folder}"
  setup_env
  mkdir -p "$OUT"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
      --format=csv > "$OUT/gpu.txt" 2>&1
  fi
  if [[ ,$PATHS, == *,hf-quantized,* ]]; then
    (python3 -c "from kvtax.harness.hf_quantized import prepare_quanto; print(prepare_quanto('$DEVICE'))" \
      > "$OUT/quanto_build.log" 2>&1 &)
  fi
  local prev run rc
  prev=$(ls -d "$RUNS_DIR"/*/config.json 2>/dev/null | head -1)
  local t0=$SECONDS
  if [[ -n $prev ]]; then
    prev=$(dirname "$prev")
    run="$OUT/$(basename "$prev")"
    cp -r "$prev" "$run" && chmod -R u+w "$run"
    say "resuming $(basename "$run") (carried in from $prev)"
    timeout -s KILL "$HARD_S" python3 -m kvtax bench --resume "$run" --budget-s "$BUDGET_S" \
      --timeout "$CELL_TIMEOUT" --no-report 2>&1 | tee -a "$OUT/sweep.log"
    rc=${PIPESTATUS[0]}
  else
    say "new sweep: $MODEL on $DEVICE, contexts $CONTEXTS, $REPS reps"
    timeout -s KILL "$HARD_S" python3 -m kvtax bench --device "$DEVICE" --model "$MODEL" \
      --contexts "$CONTEXTS" --kv "$KV" --paths "$PATHS" --reps "$REPS" --warmup "$WARMUP" \
      --decode-tokens "$DECODE_TOKENS" --presize --timeout "$CELL_TIMEOUT" \
      --max-context "$MAX_CONTEXT" --skip-after-failure --rounds --claims "$CLAIMS" \
      --budget-s "$BUDGET_S" --out "$OUT" --name "$NAME" --no-report ${EXTRA_ARGS:-} \
      2>&1 | tee -a "$OUT/sweep.log"
    rc=${PIPESTATUS[0]}
    run=$(ls -d "$OUT"/*-"$NAME"* 2>/dev/null | head -1)
  fi
  say "sweep process ended after $((SECONDS - t0)) s (rc $rc)"
  [[ -n ${run:-} && -f $run/config.json ]] && run_rows "$run" | tee -a "$OUT/sweep.log"
}

collect() {  # copy a call's returned run folder (and its log) into $RUNS_DIR
  local src=${1:?usage: h200_sweep.sh collect <files_at>}
  local run
  run=$(ls -d "$src"/*/config.json 2>/dev/null | head -1)
  [[ -n $run ]] || { say "no run folder under $src"; return 1; }
  run=$(dirname "$run")
  mkdir -p "$RUNS_DIR/logs"
  for old in "$RUNS_DIR"/*/config.json; do  # one run folder only: the newest copy wins
    [[ -e $old ]] && [[ $(basename "$(dirname "$old")") != "$(basename "$run")" ]] &&
      { say "refusing: $RUNS_DIR already holds another run, $(dirname "$old")"; return 1; }
  done
  rm -rf "$RUNS_DIR/$(basename "$run")"
  cp -r "$run" "$RUNS_DIR/" && chmod -R u+w "$RUNS_DIR/$(basename "$run")"
  local stamp; stamp=$(date -u +%Y%m%dT%H%M%SZ)
  for f in sweep.log gpu.txt quanto_build.log; do
    [[ -f $src/$f ]] && cp "$src/$f" "$RUNS_DIR/logs/$stamp-$f"
  done
  chmod -R u+w "$RUNS_DIR/logs"
  PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" run_rows "$RUNS_DIR/$(basename "$run")"
  say "next device call carries: [\"wheels\", \"$RUNS_DIR\"]"
}

report() {
  local run
  run=$(ls -d "$RUNS_DIR"/*/config.json 2>/dev/null | head -1)
  [[ -n $run ]] || { say "no run under $RUNS_DIR; collect first"; return 1; }
  run=$(dirname "$run")
  export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
  run_rows "$run"
  python3 -m kvtax report "$run" ${PRICE:+--price-per-hour "$PRICE"}
}

dry_run() {  # the whole flow on CPU: call 1 cut by its budget, collect, call 2, report
  local tmp; tmp=$(mktemp -d /tmp/h200-sweep-dry.XXXXXX)
  export RUNS_DIR=$tmp/runs SITE=${DRY_SITE:-/tmp/kvtax-dry-site} MODEL=tiny DEVICE=cpu CONTEXTS=${DRY_CONTEXTS:-64,128,256}
  export REPS=2 DECODE_TOKENS=3 MAX_CONTEXT=unfused=128,hf-quantized=128 CELL_TIMEOUT=300
  export EXTRA_ARGS="--chunk-size 64"
  say "dry run in $tmp"
  OUT=$tmp/call1 BUDGET_S=${DRY_BUDGET1:-40} HARD_S=300 device_run || return 1
  collect "$tmp/call1" || return 1
  OUT=$tmp/call2 BUDGET_S=900 HARD_S=900 device_run || return 1
  collect "$tmp/call2" || return 1
  report || return 1
  local run; run=$(dirname "$(ls -d "$RUNS_DIR"/*/config.json | head -1)")
  PYTHONPATH="$ROOT/src" python3 - "$run" <<'EOF'
import collections, json, sys
from pathlib import Path
from kvtax.harness.plan import SweepConfig, plan_cells
from kvtax.harness.store import RunStore
store = RunStore.open(sys.argv[1])
planned = [c.cell_id for c in plan_cells(SweepConfig.from_dict(store.config()))]
rows = store.rows()
ids = [r["cell_id"] for r in rows]
assert sorted(ids) == sorted(planned), "rows differ from the plan (lost or duplicated cells)"
status = collections.Counter(r["status"] for r in rows)
env = json.loads((Path(sys.argv[1]) / "env.json").read_text())
assert len(env.get("previous", [])) == 1, "env.json should remember the first call"
assert (Path(sys.argv[1]) / "report.md").exists()
print(f"dry run OK: {len(rows)} rows = plan, statuses {dict(status)}, resumed once")
EOF
}

case "${1:-run}" in
  run) device_run ;;
  collect) collect "${2:-}" ;;
  report) report ;;
  dry-run) dry_run ;;
  *) echo "usage: $0 [run|collect <files_at>|report|dry-run]" >&2; exit 2 ;;
esac
