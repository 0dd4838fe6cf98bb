"""Is kvtax decode slower after the full grid's history, and is it the cache's placement?

The full attention grid (benchmarks/attention.py, every arm) times kvtax decode at 128k ~11%
slower than grids without the unfused arm's prefill cells, with identical PTX; the same
tensors read by cuDNN do not slow. This script isolates it in one process, one Llama-3.1-8B
layer at --context:

  fresh        kvtax decode over caches built first, nothing run before
  history      the grid's prefill cells at --history-contexts (kvtax, cuDNN and the unfused
               arms by default, each built, timed and freed exactly as attention.py does)
  same         the `fresh` caches again, the same tensors (nothing moved)
  realloc      a copy with the same contents allocated after the history
  realloc+ec   the same after torch.cuda.empty_cache()

Beside each time: the Triton variants compiled so far, where each tensor lies and the clocks
(benchmarks/introspect.py). `same` slow while `fresh` was fast: the history changed the
process, not the cache; only `realloc` slow: where the allocator puts the cache matters.

    python benchmarks/decode_history.py --out runs/decode-history
    python benchmarks/decode_history.py --history-arms none     # the control: no history
    python benchmarks/decode_history.py --dry-run                # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

import attention as grid  # noqa: E402  (benchmarks/, the script's folder)
from introspect import record  # noqa: E402

from kvtax.cache import FullCache  # noqa: E402
from kvtax.harness.bench.gpu_timer import Timer  # noqa: E402

# The grid's prefill cells that run before its 128k decode cells (attention.py runs decode then
# prefill per context): a reduced grid of these arms without the unfused ones stays fast.
HISTORY = ["kvtax-fp16", "kvtax-int8", "sdpa-cudnn", "unfused-int8", "unfused-int4"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=131072, help="decode context (tokens)")
    p.add_argument("--formats", nargs="+", default=["fp16", "int8", "int4"])
    p.add_argument("--history-contexts", type=int, nargs="+",
                   default=[4096, 16384, 65536],
                   help="contexts of the prefill cells run in between (default: the grid's "
                        "before its 128k decode)")
    p.add_argument("--history-arms", nargs="+", default=HISTORY,
                   help="attention.py prefill arms run in between, or 'none' (the control)")
    p.add_argument("--reps", type=int, default=25, help="timed graph replays per cell")
    p.add_argument("--after-order", nargs="+", default=None,
                   help="order of the formats timed after the history (default: --formats)")
    p.add_argument("--repeat", type=int, default=0,
                   help="right after the history, time the first format this many times back "
                        "to back ('settle' rows carry seconds since the history ended): does "
                        "a slow cell speed up with time or with replays?")
    p.add_argument("--trace", type=int, default=0,
                   help="right after the history (and --pause), time this many replays of the "
                        "first format with no warm-up and keep every sample ('trace' row): how "
                        "long the slow state lasts")
    p.add_argument("--warmup-ms", type=float, default=None,
                   help="the timer's warm-up by time (default: the harness timer's)")
    p.add_argument("--pause", type=float, default=0.0,
                   help="seconds to sleep after the history before timing anything")
    p.add_argument("--out", default="runs/decode-history")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no graphs")
    return p.parse_args(argv)


def build(fmt: str, kv: list[torch.Tensor], ctx: int) -> FullCache:
    """A cache of format `fmt` holding kv ([B, H_kv, ctx, D] fp16 each), freshly allocated."""
    cache = FullCache(fmt, capacity=ctx)
    cache.append(*kv)
    return cache


def time_decode(stage, caches, q, lengths, timer, log, since=None) -> None:
    """One row per format: kvtax decode over caches[fmt] with its introspection record
    (`since`: a time.monotonic() stamp; rows then carry the seconds elapsed from it)."""
    for fmt, cache in caches.items():
        view = cache.view()
        fn = grid.kvtax_arm(q, view, lengths)
        t0 = time.monotonic()
        ms, p20, p80 = timer(fn)
        extra = {} if since is None else {"t_s": round(t0 - since, 4)}
        row = dict(stage=stage, format=fmt, ctx=view.length, median_ms=ms, p20_ms=p20,
                   p80_ms=p80, **extra, **record(view, q, {"lengths": lengths}))
        log(row)
        print(f"{stage:11s} {fmt:5s} {ms:8.4f} ms  (p20 {p20:.4f}, p80 {p80:.4f})  "
              f"clocks {row['clocks']}", flush=True)


def trace(fmt, cache, q, lengths, args, log, since) -> None:
    """Every sample of `args.trace` replays with no warm-up, and the wall time they took."""
    view = cache.view()
    t0 = time.monotonic()
    ts = Timer(args.reps, args.dry_run, warmup_ms=0).samples(
        grid.kvtax_arm(q, view, lengths), args.trace)
    wall = time.monotonic() - t0
    log(dict(stage="trace", format=fmt, ctx=view.length, t_s=round(t0 - since, 4),
             wall_s=round(wall, 4), samples_ms=[round(t, 5) for t in ts]))
    k = max(1, len(ts) // 10)
    print(f"trace       {fmt:5s} {len(ts)} replays in {wall * 1e3:.0f} ms; medians per tenth: "
          + " ".join(f"{sorted(ts[i:i + k])[len(ts[i:i + k]) // 2]:.4f}"
                     for i in range(0, len(ts), k)), flush=True)


def history(args, timer, log) -> None:
    """The grid's prefill cells at each history context, as attention.py runs them."""
    if args.history_arms == ["none"]:
        return
    gargs = grid.parse_args(["--dry-run"] if args.dry_run else [])
    gargs.reps = args.reps
    for ctx in args.history_contexts:
        cells = [(ctx, "prefill", arm) for arm in args.history_arms]
        for row in grid.run_context(ctx, cells, timer, float("nan"), gargs, time.time()):
            log(dict(stage="history", **{k: row.get(k) for k in
                                         ("arm", "ctx", "status", "median_ms", "transient_mib",
                                          "note")}))
            print(f"history     {row['arm']} ctx {ctx}: {row['status']} "
                  f"{row.get('median_ms', float('nan')):.2f} ms", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.after_order and sorted(args.after_order) != sorted(args.formats):
        sys.exit("decode_history.py: --after-order must list exactly the --formats")
    dev = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.context, args.history_contexts, args.reps = 96, [64, 96], 3
    b, hkv, hq, d = 1, (2 if args.dry_run else 8), (8 if args.dry_run else 32), \
        (64 if args.dry_run else 128)
    out = Path(args.out) / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(
        command="python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        date=dt.datetime.now().isoformat(timespec="seconds"), torch=torch.__version__,
        device=torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (dry run)",
        args=vars(args)), indent=2))
    rows_file = open(out / "rows.jsonl", "a")

    def log(row: dict) -> None:
        rows_file.write(json.dumps(row, default=str) + "\n")
        rows_file.flush()

    timer = Timer(args.reps, args.dry_run) if args.warmup_ms is None else \
        Timer(args.reps, args.dry_run, warmup_ms=args.warmup_ms)
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = [torch.randn(b, hkv, args.context, d, generator=gen, device=dev, dtype=torch.float16)
          for _ in range(2)]
    q = torch.randn(b, hq, 1, d, generator=gen, device=dev, dtype=torch.float16)
    lengths = torch.full((b,), args.context, dtype=torch.int32, device=dev)
    fresh = {fmt: build(fmt, kv, args.context) for fmt in args.formats}
    time_decode("fresh", fresh, q, lengths, timer, log)
    history(args, timer, log)
    if dev == "cuda":
        torch.cuda.synchronize()
    ended = time.monotonic()
    if args.pause:
        time.sleep(args.pause)
    order = args.after_order or args.formats
    first = {order[0]: fresh[order[0]]}
    if args.trace:
        trace(order[0], fresh[order[0]], q, lengths, args, log, ended)
    for _ in range(args.repeat):
        time_decode("settle", first, q, lengths, timer, log, since=ended)
    time_decode("same", {f: fresh[f] for f in order}, q, lengths, timer, log, since=ended)
    time_decode("realloc", {f: build(f, kv, args.context) for f in args.formats}, q, lengths,
                timer, log)
    if dev == "cuda":
        torch.cuda.empty_cache()
    time_decode("realloc+ec", {f: build(f, kv, args.context) for f in args.formats}, q,
                lengths, timer, log)
    rows_file.close()
    print(f"rows in {out / 'rows.jsonl'}")


if __name__ == "__main__":
    main()
