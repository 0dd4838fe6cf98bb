#!/usr/bin/env bash
# The quality evaluation of the recommended KV formats (docs/QUALITY.md's lead table): KL,
# top-1 and perplexity delta against fp16 KV at 8k/16k/32k on the usual text and on the
# held-out text (benchmarks/data/held_out_text.txt, never tuned on), and planted-fact recall
# over 4 seeds, for q4, q3 and q8, on one model per call. Recall is the long part: on an H200,
# four seeds sharing the GPU ran fp16 + q4 at 8k-32k and q3 at 8k-16k in 500 s, and q3 at 32k
# (no 3-bit kernel yet: the torch reference path) did not finish 8 facts in 330 s.
#
#   benchmarks/q4_quality.sh MODEL.gguf OUT_DIR [DEVICE]     # DEVICE: cuda (default) or cpu
#
# Environment: CONTEXTS (8192,16384,32768), KV (the arms), SEEDS (0 1 2 3), DTYPE (float32,
# as the earlier tables: fp32 model, fp16-KV baseline), CHUNK (2048), RECALL=0 skips recall.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
die() { echo "q4_quality.sh: $*" >&2; exit 2; }
[[ $# -ge 2 ]] || die "usage: benchmarks/q4_quality.sh MODEL.gguf OUT_DIR [cuda|cpu]"
MODEL=$1 OUT=$2 DEVICE=${3:-cuda}
[[ -f $MODEL ]] || die "no model file $MODEL"
CONTEXTS=${CONTEXTS:-8192,16384,32768}
KV=${KV:-q4,q3,q8}
SEEDS=${SEEDS:-0 1 2 3}
DTYPE=${DTYPE:-float32}
CHUNK=${CHUNK:-2048}
RECALL=${RECALL:-1}
TEXT2=benchmarks/data/held_out_text.txt
mkdir -p "$OUT"
common=(--model "$MODEL" --contexts "$CONTEXTS" --device "$DEVICE" --dtype "$DTYPE"
        --chunk-size "$CHUNK")
rc=0
python3 -m kvtax quality "${common[@]}" --kv "$KV" --tail 128 --baseline fp16 \
  --out "$OUT/quality-usual" 2>&1 | tee "$OUT/quality-usual.log"
[[ ${PIPESTATUS[0]} == 0 ]] || rc=1
python3 -m kvtax quality "${common[@]}" --kv "$KV" --tail 128 --baseline fp16 \
  --text "$TEXT2" --out "$OUT/quality-heldout" 2>&1 | tee "$OUT/quality-heldout.log"
[[ ${PIPESTATUS[0]} == 0 ]] || rc=1
if [[ $RECALL == 1 ]]; then
  for s in $SEEDS; do
    python3 -m kvtax recall "${common[@]}" --kv "fp16,${KV}" --facts 8 --seed "$s" \
      --out "$OUT/recall-s$s" 2>&1 | tee "$OUT/recall-s$s.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
  done
fi
exit $rc
