"""Cache writes of one decode step: the fused quantize-and-store kernel vs the torch path (GPU).

One decode step writes one token's K and V into every layer's cache. The torch path
quantizes with `fmt.quantize` and copies each storage part (~15 small kernels a layer);
the fused path is one Triton launch a layer (`kvtax.formats.store_triton`). Defaults are
Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, batch 1, bf16.

Per format and path: a CUDA graph of the whole step's `write_at` calls (what the runner
replays) timed with CUDA events, median and p20/p80 of --reps replays; the same step run
eagerly (host overhead included, wall clock); kernel launches per step (profiler); and,
with --chunk, one prefill chunk appended eagerly to every layer. Fused and torch storage
are compared byte for byte after the step (`identical`).

    PYTHONPATH=src python benchmarks/quantize.py --out runs/quantize
    PYTHONPATH=src python benchmarks/quantize.py --formats int4 k8v4 --chunk 0 --reps 200

Writes OUT/<timestamp>/quantize.json (config + rows) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from kvtax.harness.bench.gpu_timer import capture_graph, git_commit as _git_commit

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["fp16", "int8", "int4", "fp8", "k8v4"],
                   help="KV specs (default: fp16 int8 int4 fp8 k8v4)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="model dtype")
    p.add_argument("--position", type=int, default=4096,
                   help="token position written (default 4096)")
    p.add_argument("--chunk", type=int, default=2048,
                   help="also time appending a prefill chunk of this many tokens (0: skip)")
    p.add_argument("--reps", type=int, default=100, help="timed graph replays (default 100)")
    p.add_argument("--launches", nargs="*", default=[], metavar="fused-rRwW",
                   help="also time the fused kernel with R rows per program and W warps "
                        "(e.g. fused-r1w1 fused-r2w2) instead of its heuristic")
    p.add_argument("--out", default="runs/quantize", help="results go to OUT/<timestamp>/")
    return p.parse_args(argv)


def _stats(ts: list[float]) -> dict:
    ts = sorted(ts)
    q = lambda f: ts[min(len(ts) - 1, int(f * (len(ts) - 1) + 0.5))]  # noqa: E731
    return {"median_ms": statistics.median(ts), "p20_ms": q(0.2), "p80_ms": q(0.8)}


def _caches(spec: str, fused: bool, args, k, v):
    """One preallocated FullCache per layer holding one token, writes routed `fused` or not."""
    from kvtax.cache import FullCache

    caches = []
    for _ in range(args.layers):
        c = FullCache(spec, capacity=args.position + max(args.chunk, 1) + 1, check_finite=False)
        c.fused_store = fused
        c.append(k, v)
        caches.append(c)
    return caches


def _graph_ms(step, reps: int) -> dict:
    graph = capture_graph(step)
    events = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return _stats([s.elapsed_time(e) for s, e in events])


def _eager_ms(step, reps: int) -> dict:
    step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return _stats(ts)


def _launches(step) -> int | None:
    """CUDA kernels (and memcpy/memset) one eager call of `step` launches."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    except Exception:  # noqa: BLE001  (profiler unavailable: leave the count out)
        return None


def run_format(spec: str, args) -> list[dict]:
    dev, dtype = torch.device("cuda"), DTYPES[args.dtype]
    b, h, d = args.batch, args.kv_heads, args.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)
    new = lambda t: torch.randn(b, h, t, d, generator=gen, device=dev).to(dtype)  # noqa: E731
    k1, v1, k0, v0 = new(1), new(1), new(1), new(1)
    pos_t = torch.tensor([args.position], device=dev)
    chunk = (new(args.chunk), new(args.chunk)) if args.chunk else None
    rows, stores = [], {}
    from kvtax.formats import store_triton

    for path in ("fused", "torch", *args.launches):
        # fused-rRwW: the fused kernel with R rows per program and W warps (not the heuristic)
        launch = tuple(int(x) for x in path[7:].lstrip("r").split("w")) if path[6:] else None
        store_triton.LAUNCH_OVERRIDE = launch
        store_triton._OP_PLANS.clear()
        caches = _caches(spec, path != "torch", args, k0, v0)

        def step() -> None:
            for c in caches:
                c.write_at(k1, v1, pos_t)

        row = {"spec": spec, "path": path, "layers": args.layers, "kv_heads": h,
               "head_dim": d, "batch": b, "dtype": args.dtype}
        row.update({f"graph_{k}": val for k, val in _graph_ms(step, args.reps).items()})
        eager = _eager_ms(step, max(10, args.reps // 5))
        row.update({f"eager_{k}": val for k, val in eager.items()})
        row["launches_per_step"] = _launches(step)
        if chunk is not None:
            def prefill() -> None:
                for c in caches:
                    c.append(*chunk)
                    c.trim(args.chunk)

            row.update({f"chunk_{k}": val for k, val in _eager_ms(prefill, 10).items()})
            row["chunk_tokens"] = args.chunk
        stores[path] = [c.store for c in caches]
        rows.append(row)
    store_triton.LAUNCH_OVERRIDE = None
    store_triton._OP_PLANS.clear()
    torch.cuda.synchronize()
    # slots written by both paths: the first token, the chunk after it, the decode token
    written = [(0, 1 + args.chunk), (args.position, args.position + 1)]
    same = all(
        torch.equal(_bytes(x[:, :, lo:hi]), _bytes(y[:, :, lo:hi]))
        for sf, st in zip(stores["fused"], stores["torch"])
        for x, y in zip(sf.k.parts() + sf.v.parts(), st.k.parts() + st.v.parts())
        for lo, hi in written
    )
    for r in rows:  # every fused variant wrote the same bytes as the torch path
        r["identical"] = same and all(
            torch.equal(_bytes(x[:, :, lo:hi]), _bytes(y[:, :, lo:hi]))
            for p in args.launches
            for sf, st in zip(stores[p], stores["torch"])
            for x, y in zip(sf.k.parts() + sf.v.parts(), st.k.parts() + st.v.parts())
            for lo, hi in written)
    return rows


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def table(rows: list[dict]) -> str:
    head = ("| spec | path | graph ms/step (p20-p80) | eager ms/step | launches/step | "
            "chunk ms | identical |")
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        chunk = f"{r['chunk_median_ms']:.3f}" if "chunk_median_ms" in r else "-"
        lines.append(
            f"| {r['spec']} | {r['path']} | {r['graph_median_ms']:.4f} "
            f"({r['graph_p20_ms']:.4f}-{r['graph_p80_ms']:.4f}) | {r['eager_median_ms']:.3f} | "
            f"{r['launches_per_step']} | {chunk} | {r['identical']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/quantize.py needs CUDA (it times GPU kernels); nothing to do here")
        return 0
    import triton

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(
        command="python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        date=dt.datetime.now().isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(0), torch=torch.__version__,
        triton=triton.__version__, git=_git_commit(), args=vars(args),
    )
    rows = []
    for spec in args.formats:
        rows += run_format(spec, args)
        print("\n".join(table(rows[-2:]).splitlines()[2:]), flush=True)
    (out_dir / "quantize.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    print(f"\n{config['device']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"{args.layers} layers x {args.kv_heads} KV heads x D {args.head_dim}, "
          f"batch {args.batch}, {args.dtype}\n")
    print(table(rows))
    print(f"\nresults in {out_dir / 'quantize.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
