# The preamble the H200 device scripts (h200_s*.sh) share; sourced from the repo root with
# $OUT set (the device tool's output folder). Sets PYTHONPATH to this checkout's src/,
# R=$OUT/r (created), writes $R/gpu.txt (GPU, driver, clocks, power; torch, its CUDA,
# triton), XDIST (pytest-xdist's "-n 12" where the machine has it, else empty), and the
# helpers gpu_tests and decode_variants.
: "${OUT:?set OUT to the output folder of the device call}"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv > "$R/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)" >> "$R/gpu.txt"
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n 12"
gpu_tests() {  # gpu_tests LOG SECONDS FILES...: pytest on the GPU, failures and the tally
  local log=$1 secs=$2; shift 2
  timeout "$secs" python3 -m pytest -q -p no:cacheprovider $XDIST "$@" > "$R/$log" 2>&1
  grep -E "^(FAILED|ERROR)" "$R/$log" | head; tail -1 "$R/$log"
}
decode_variants() {  # decode_variants TAG SECONDS KV VARIANTS [decode.py args...]: decode.py
  # with launch variants (benchmarks/variants.py) side by side, profiled; its tables shown
  local tag=$1 secs=$2 kv=$3 vs=$4; shift 4
  timeout "$secs" python3 benchmarks/decode.py --kv "$kv" --compile on --tokens 32 \
    --warmup 4 --profile 2 --variants "$vs" --out "$R/$tag.json" "$@" > "$R/$tag.log" 2>&1
  echo "== $tag"; grep -E "^\||^#|^ctx|Error" "$R/$tag.log" | cut -c1-300
}
