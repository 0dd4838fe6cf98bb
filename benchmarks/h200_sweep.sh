#!/usr/bin/env bash
# The sweep of record on one H200: Llama-3.1-8B shapes (random weights), contexts 4k-128k,
# KV fp16 / int8 / int4 / fp8 on kvtax's fused path, stock fp16 (torch SDPA), and the
# mlx-lm-style (unfused) and transformers-style (dequant) baselines where they fit; 3
# repetitions, presized caches; then `kvtax report` on the run folder.
#
#   benchmarks/h200_sweep.sh [--out DIR]         new sweep into DIR/<UTC time>-h200-sweep/
#                                                (DIR: $OUT_DIR when set, else runs/h200-sweep)
#   benchmarks/h200_sweep.sh --resume RUN_DIR    finish it in a second call (a read-only
#                                                RUN_DIR is copied under DIR first)
#   benchmarks/h200_sweep.sh --plan              print the planned cells and time, run nothing
#
# Each call stays under 9 minutes: `--budget-s BUDGET_S` (470 s) starts no cell likely to end
# later (estimated from measured cells of the same arm), `timeout -s KILL HARD_S` (510 s) is
# the backstop, and the report is written once, by the call that completes the run (exit 3:
# cells are left, resume). Rows are fsynced one by one, so a call cut short keeps every
# finished cell and the resume runs exactly the cells without a row.
#
# The grid: 11 arms x 5 contexts x 3 repetitions + 11 warm-ups; 30 of them (the fp8
# baselines) are rows with status "skipped": mlx-lm's and transformers' quantized caches have
# no fp8 format, so there is no stack for them to stand for. The baselines run at every
# context (unfused materializes [32 heads, 2048-token chunk, context] scores in the model
# dtype, ~34 GB at the last 128k chunk; dequant a whole dequantized copy of the cache per
# decode step): both fit an H200. On 2026-12-02 the cells took 1,567 s on one H200 (767 s
# of it the unfused arm: 77 s of prefill per 128k cell), i.e. four calls of ~9 minutes.
# Override any of them through the environment (MODEL, CONTEXTS, KV, PATHS, REPS,
# DECODE_TOKENS, MAX_CONTEXT, BUDGET_S, HARD_S, CELL_TIMEOUT, PER_CELL_S).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

MODEL=${MODEL:-llama-3.1-8b}
DEVICE=${DEVICE:-cuda}
CONTEXTS=${CONTEXTS:-4k,16k,32k,64k,128k}
KV=${KV:-fp16,int8,int4,fp8}
PATHS=${PATHS:-fused,fp16,unfused,dequant}
REPS=${REPS:-3}
DECODE_TOKENS=${DECODE_TOKENS:-32}
MAX_CONTEXT=${MAX_CONTEXT:-fp8/unfused=0,fp8/dequant=0}
BUDGET_S=${BUDGET_S:-470}      # start no cell likely to end later than this (seconds)
HARD_S=${HARD_S:-510}          # kill the sweep here whatever it is doing
CELL_TIMEOUT=${CELL_TIMEOUT:-420}  # unfused prefill at 128k: ~1-2 min
PER_CELL_S=${PER_CELL_S:-10}  # for the printed plan only
CLAIMS=${CLAIMS:-benchmarks/h200_claims.json}
EXTRA_ARGS=${EXTRA_ARGS:-}

say() { echo "[h200_sweep] $*"; }
die() { echo "h200_sweep.sh: $*" >&2; exit 2; }

OUTDIR=${OUT_DIR:-runs/h200-sweep}
RESUME=""
PLAN_ONLY=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) OUTDIR=${2:?--out needs a folder}; shift 2 ;;
    --resume) RESUME=${2:?--resume needs a run folder}; shift 2 ;;
    --plan) PLAN_ONLY=1; shift ;;
    -h|--help) sed -n '2,/^# DECODE_TOKENS/p' "$0" | cut -c3-; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

BENCH_ARGS=(--device "$DEVICE" --model "$MODEL" --contexts "$CONTEXTS" --kv "$KV"
  --paths "$PATHS" --reps "$REPS" --decode-tokens "$DECODE_TOKENS" --presize --rounds
  --max-context "$MAX_CONTEXT" --skip-after-failure --claims "$CLAIMS")
# shellcheck disable=SC2206
BENCH_ARGS+=($EXTRA_ARGS)

plan() {  # planned cells of a new sweep (args) or of a run folder (--run DIR)
  python3 - "$PER_CELL_S" "$BUDGET_S" "$@" <<'EOF'
import argparse, math, sys
from kvtax.harness.bench.plan import SweepConfig, plan_cells
from kvtax.harness.store import RunStore
from kvtax.harness.bench.sweep import skip_reason
per, budget, rest = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
done: set[str] = set()
if rest[:1] == ["--run"]:
    store = RunStore.open(rest[1])
    cfg, done = SweepConfig.from_dict(store.config()), store.done_cell_ids()
else:
    from kvtax.cli import bench
    ap = argparse.ArgumentParser()
    bench.register(ap.add_subparsers())
    cfg = bench._config(ap.parse_args(["bench", *rest]))
cells = [c for c in plan_cells(cfg) if c.cell_id not in done]
skip = [c for c in cells if skip_reason(c, cfg, {})]
arms = sorted({c.arm for c in cells})
run = len(cells) - len(skip)
print(f"[h200_sweep] planned: {len(cells)} cells to do ({run} to run, {len(skip)} skipped "
      f"rows by --max-context), {len(arms)} arms: {', '.join(arms)}")
print(f"[h200_sweep] ~{run * per / 60:.1f} min at ~{per:g} s per cell: "
      f"{max(1, math.ceil(run * per / budget))} call(s) of {budget:.0f} s")
EOF
}

if [[ -n $RESUME ]]; then
  [[ -f $RESUME/config.json ]] || die "$RESUME is not a run folder (no config.json)"
  mkdir -p "$OUTDIR"
  if [[ $(cd "$RESUME/.." && pwd) != $(cd "$OUTDIR" && pwd) ]]; then
    rm -rf "${OUTDIR:?}/$(basename "$RESUME")"
    cp -r "$RESUME" "$OUTDIR/" && chmod -R u+w "$OUTDIR/$(basename "$RESUME")"
    RESUME=$OUTDIR/$(basename "$RESUME")
    say "resuming a copy: $RESUME"
  fi
  plan --run "$RESUME" || exit 1
  [[ $PLAN_ONLY == 1 ]] && exit 0
  RUN=$RESUME
  timeout -s KILL "$HARD_S" python3 -m kvtax bench --resume "$RUN" --budget-s "$BUDGET_S" \
    --timeout "$CELL_TIMEOUT" --no-report 2>&1 | tee -a "$OUTDIR/sweep.log"
  rc=${PIPESTATUS[0]}
else
  plan "${BENCH_ARGS[@]}" || exit 1
  [[ $PLAN_ONLY == 1 ]] && exit 0
  mkdir -p "$OUTDIR"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv > "$OUTDIR/gpu.txt" 2>&1
  timeout -s KILL "$HARD_S" python3 -m kvtax bench "${BENCH_ARGS[@]}" --timeout "$CELL_TIMEOUT" \
    --budget-s "$BUDGET_S" --out "$OUTDIR" --name h200-sweep --no-report 2>&1 \
    | tee -a "$OUTDIR/sweep.log"
  rc=${PIPESTATUS[0]}
  RUN=$(ls -dt "$OUTDIR"/*-h200-sweep 2>/dev/null | head -1)
  [[ -n $RUN && -f $OUTDIR/gpu.txt ]] && cp "$OUTDIR/gpu.txt" "$RUN/gpu.txt"  # travels with it
fi
say "sweep process ended (rc $rc)"
[[ -n ${RUN:-} && -f $RUN/config.json ]] || { say "no run folder was written"; exit 1; }
left=$(plan --run "$RUN" | sed -n 's/.*planned: \([0-9]*\) cells to do.*/\1/p')
if [[ ${left:-1} != 0 ]]; then
  say "$left cell(s) left: finish with benchmarks/h200_sweep.sh --resume $RUN"
  exit 3
fi
python3 -m kvtax report "$RUN" || exit 1
say "complete: $RUN/report.md"
