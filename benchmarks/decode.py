"""Decode ms/token of the kvtax runner against the bytes roofline, per context and KV format.

A batch-1 decode step must read every weight once and the whole KV cache once, so its floor
is (weight bytes + KV bytes) / memory read bandwidth. This script measures that bandwidth in
the same run (a large device copy and a large reduction; the faster one counts, so the
roofline is the stricter one), builds a model with random weights (default Llama-3.1-8B
shapes in bf16), and for each context and KV format times real decode steps of the model
(CUDA-graph replay where available; median and p20/p80 over --tokens steps, CUDA events).
A timed step is the runner's greedy step (`Runner.decode_greedy`: the argmax inside the
graph, which feeds its own next replay); `--step logits` (or the variant `step.greedy=0`)
times `decode_step` (logits out of the graph) then `sample` instead.

The prompt is NOT prefetched through the model: to reach 128k in seconds the cache is
filled directly with random K/V (N(0, 1), quantized on append exactly as a prefill would
store it), then every timed step is the real model step, attention over the filled cache
included. Decode cost does not depend on what the cached values are.

    python benchmarks/decode.py --contexts 4k,16k,32k,64k,128k --kv fp16,int8,int4 \\
        --out results/decode-h200.json
    python benchmarks/decode.py --device cpu --config tiny --contexts 64,128   # smoke test

A cell that runs out of memory (or fails otherwise) becomes a row with its error; the
sweep continues.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import variants  # noqa: E402
from kvtax.models import Runner, get_config, load_model  # noqa: E402
from kvtax.models.sampling import sample  # noqa: E402  (greedy: the one-launch argmax)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default="llama-3.1-8b",
                   help="built-in config (default llama-3.1-8b)")
    p.add_argument("--contexts", default="4k,16k,32k,64k,128k",
                   help="cached tokens before timing; k = 1024 (default 4k,16k,32k,64k,128k)")
    p.add_argument("--kv", default="fp16,int8,int4", help="KV formats (default fp16,int8,int4)")
    p.add_argument("--tokens", type=int, default=64,
                   help="timed decode steps per cell (default 64)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (default 8)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="weight dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--no-cuda-graph", action="store_true", help="time eager decode instead")
    p.add_argument("--step", choices=["greedy", "logits"], default="greedy",
                   help="what a timed step is: greedy (Runner.decode_greedy, the argmax "
                        "captured with the step; default) or logits (decode_step, then the "
                        "argmax outside the graph)")
    p.add_argument("--compile", choices=["off", "on", "both"], default="off",
                   help="torch.compile the decode step before capturing its graph (fuses "
                        "norms, RoPE, adds; compile time is excluded from the timing); "
                        "'both' times every cell plain and compiled, side by side")
    p.add_argument("--bw-mib", type=int, default=None,
                   help="buffer for the bandwidth probe in MiB (default 4096 CUDA, 256 CPU)")
    p.add_argument("--max-cell-seconds", type=float, default=60.0,
                   help="stop timing a cell after this long (slow fallback paths; default 60)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile N eager decode steps per cell: GPU kernel time per "
                        "step by kind (GEMM, attention, cache store, norm, other) and the "
                        "launch count, to see where the time over the roofline goes")
    p.add_argument("--gemv", choices=["auto", "torch", "triton"], default="auto",
                   help="decode linear layers: triton (kvtax's fused GEMVs: norm + qkv, wo + "
                        "residual, norm + gate/up + SiLU, w2 + residual, norm + lm_head), torch "
                        "(F.linear + separate norms/adds) or auto (the runner's default: "
                        "triton on CUDA where the architecture allows, else torch)")
    p.add_argument("--gemv-override", default="", metavar="FIELD=V,...",
                   help="replace fields of every default GEMV launch (GemvConfig: block_n, "
                        "block_k, split_k, num_warps, num_stages), e.g. num_stages=2; the "
                        "same as --variants gemv.FIELD=V,...")
    p.add_argument("--variants", default="", metavar="V;V...",
                   help="launch variants, ';'-separated, each timed as its own cell in this "
                        "process: comma-separated SCOPE.FIELD=INT with SCOPE gemv, a "
                        "projection (qkv, o, gate_up, down, lm_head) or attn (the decode "
                        "attention launch: per_sm, num_stages, ...); an empty variant is the "
                        "defaults (benchmarks/variants.py)")
    p.add_argument("--out", type=Path, default=None, help="write rows + run metadata as JSON")
    return p.parse_args(argv)


def variant_list(args: argparse.Namespace) -> list[str]:
    """The launch variants to time (benchmarks/variants.py syntax), checked up front."""
    if args.gemv_override and args.variants:
        raise SystemExit("give --gemv-override or --variants, not both")
    if args.gemv_override:
        texts = [",".join(f"gemv.{t.strip()}" for t in args.gemv_override.split(",")
                          if t.strip())]
    else:
        texts = [t.strip() for t in args.variants.split(";")] if args.variants else [""]
    for t in texts:
        variants.parse(t)
    return texts


def parse_contexts(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    texts = variant_list(args)
    dev = torch.device(args.device)
    dtype = _DTYPES[args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    cfg = get_config(args.config)
    contexts, formats = parse_contexts(args.contexts), [f.strip() for f in args.kv.split(",")]
    torch_bw = measure_read_bandwidth(dev, (args.bw_mib or (4096 if dev.type == "cuda" else 256))
                                      << 20)
    # The roofline divides by the best read rate this GPU showed in the run: torch's copy /
    # sum, or attention.py's streaming-read kernels (4.44-4.52 TB/s on the H200 where torch
    # measured 4.21-4.43 from call to call: the lower figure would flatter every row).
    kernel_bw = _kernel_read_ceiling() if dev.type == "cuda" else 0.0
    bw = max(torch_bw, kernel_bw)
    print(f"# {cfg.name} ({dtype}) on {_device_name(dev)}: read bandwidth {bw / 1e9:.0f} GB/s "
          f"(torch copy/sum {torch_bw / 1e9:.0f}, read kernels {kernel_bw / 1e9:.0f})",
          file=sys.stderr)
    model = load_model(cfg, dtype=dtype, device=dev, seed=0)
    weight_bytes = _weight_bytes_per_token(model)
    rows = []
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    cells = [(ctx, kv, c, v) for ctx in contexts for kv in formats for c in compiles
             for v in texts]
    for ctx, kv, compiled, variant in cells:
        row = {"config": cfg.name, "context": ctx, "kv": kv, "batch": args.batch,
               "dtype": str(dtype), "device": _device_name(dev),
               "weight_bytes": weight_bytes, "read_bw_Bps": bw, "compiled": compiled,
               "gemv": args.gemv, "variant": variant,
               "step": "greedy" if variants.greedy_step(variant, args.step == "greedy")
               else "logits"}
        try:
            with variants.apply(variant, model):
                row.update(run_cell(model, kv, ctx, args, compiled, row["step"] == "greedy"))
            total = weight_bytes + row["kv_bytes"]
            row["roofline_ms"] = 1000 * total / bw
            row["roofline_fraction"] = row["roofline_ms"] / row["ms_median"]
        except torch.cuda.OutOfMemoryError as exc:
            row["error"] = f"OOM: {str(exc).splitlines()[0]}"
        except Exception as exc:  # one bad cell must not end the sweep
            row["error"] = f"{type(exc).__name__}: {exc}"
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(_row_line(row), file=sys.stderr)
        if args.out:  # after every cell: a run cut short keeps what it measured
            write_json(args, dev, dtype, bw, torch_bw, kernel_bw, rows)
    print(markdown_table(rows))
    if args.out:
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def write_json(args, dev, dtype, bw, torch_bw, kernel_bw, rows) -> None:  # noqa: ANN001
    """Rows + run metadata to args.out (a temporary file renamed over it: never half)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = _metadata(args, dev, dtype, bw)
    meta.update(read_bw_torch_Bps=torch_bw, read_bw_kernels_Bps=kernel_bw)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    tmp.replace(args.out)


def run_cell(model, kv: str, ctx: int, args: argparse.Namespace,  # noqa: ANN001
             compiled: bool = False, greedy: bool = True) -> dict:
    """Fill a cache to `ctx` tokens with random K/V, then time real decode steps (greedy:
    Runner.decode_greedy; else decode_step and sample)."""
    dev = model.embed.weight.device
    if compiled:
        torch._dynamo.reset()  # a fresh trace per cell: new caches, no recompile limit hit
    runner = Runner(model, kv=kv, cuda_graph=False if args.no_cuda_graph else None,
                    fused_gemv={"auto": None, "torch": False, "triton": True}[args.gemv],
                    compile=compiled)
    caches = runner.make_caches(capacity=ctx + args.warmup + args.tokens + args.profile + 2)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        # chunks no longer than the runner's: sliding layers' rings are sized for them
        fill_random(caches, model, ctx, args.batch, chunk=runner.chunk_size)
        kv_bytes = sum(c.used_nbytes for c in caches)
        tok = torch.randint(0, model.config.vocab_size, (args.batch, 1), device=dev)
        step = _stepper(runner, caches, greedy)
        for _ in range(args.warmup):
            tok = step(tok)
        times = _time_steps(step, tok, args.tokens, args.max_cell_seconds)
        prof = kernel_breakdown(runner, step, tok, args.profile, greedy) if args.profile else {}
        return {
            **prof,
            "kv_bytes": kv_bytes,
            "cache_bytes": sum(c.nbytes for c in caches),
            "ms_median": statistics.median(times),
            "ms_p20": _quantile(times, 0.2),
            "ms_p80": _quantile(times, 0.8),
            "steps": len(times),
            "cuda_graph": (runner._greedy if greedy else runner._graph) is not None,
            "graph_off_reason": runner.graph_disabled_reason,
            "gemv": "triton" if runner.fused_gemv else "torch",  # what --gemv auto chose
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        }
    finally:
        runner.release_graph()
        del caches


# kernel name → kind, first match wins (cuBLAS/CUTLASS GEMV-GEMM names vary by version)
_KINDS = (
    ("gemm", ("_gemv_",)),  # kvtax's fused GEMV; its split-K reduce is no attention reduce
    ("attention", ("decode_attn", "decode_warp", "decode_swap", "prefill_attn")),
    ("store", ("quantize_store", "_store_")),
    ("gemm", ("gemv", "gemm", "cutlass", "xmma", "sm90_", "cublas", "splitk", "matmul")),
    ("norm", ("rms_norm", "rmsnorm", "norm", "rsqrt")),  # rsqrt: inductor's fused norms
)


def _stepper(runner: Runner, caches, greedy: bool):  # noqa: ANN001, ANN202
    """token ids `[B, 1]` → the next ones: one decode step as the cell times it."""
    if greedy:
        return lambda tok: runner.decode_greedy(tok, caches)
    return lambda tok: sample(runner.decode_step(tok, caches))


def kernel_breakdown(runner, step, tok, n: int, greedy: bool = True) -> dict:  # noqa: ANN001
    """GPU kernel time per decode step by kind, from torch.profiler over `n` steps.

    The steps run as the timing ran them: CUDA-graph replays (CUPTI reports the kernels
    inside a replayed graph), compiled or not; eager steps with --no-cuda-graph.
    `ms/token - kernel_ms_per_step` is then the idle time between kernels.
    """
    from torch.profiler import ProfilerActivity, profile

    if not tok.is_cuda or n <= 0:
        return {}
    tok = step(tok)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            tok = step(tok)
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    launches = 0
    top: dict[str, float] = {}
    for evt in prof.key_averages():
        us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        skip = ("cudaLaunch", "cuLaunch", "cudaGraph", "Memcpy", "Memset")
        if not us or evt.key.startswith(skip):
            continue
        name = evt.key.lower()
        kind = next((k for k, keys in _KINDS if any(x in name for x in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1000 / n
        launches += evt.count
        top[evt.key[:80]] = top.get(evt.key[:80], 0.0) + us / 1000 / n
    return {
        "profiled": "graph" if (runner._greedy if greedy else runner._graph) is not None
        and runner.cuda_graph else "eager",
        "kernel_ms_per_step": sum(by_kind.values()),
        "kernel_ms_by_kind": {k: round(v, 4) for k, v in sorted(by_kind.items())},
        "launches_per_step": launches / n,
        "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:12]),
        "gemv_by_shape": gemv_by_shape(prof, n, runner.model),
        "critical_us_by_role": critical_path(_kernel_spans(prof), n,
                                             runner.model.config.num_layers),
    }


def _kernel_spans(prof) -> list[tuple[str, float, float]]:  # noqa: ANN001
    """(name, start µs, end µs) of every device kernel the profiler saw."""
    return [(e.name, e.time_range.start, e.time_range.end)
            for e in prof.events() if _is_device_kernel(e)]


# kernel name (leading underscores dropped) → role in a decode step (critical_path); GEMVs
# get their projection by order
_ROLES = (("gemv_reduce", "gemv split-K reduce"), ("quantize_store", "store"),
          ("store_", "store"), ("decode_attn_reduce", "attention reduce"),
          ("decode_", "attention"))


def _projection_order(layers: int) -> list[str]:
    """The fused GEMV launches of one decode step, in order: four per layer, then lm_head."""
    return ["qkv", "o", "gate_up", "down"] * layers + ["lm_head"]


def critical_path(spans: list[tuple[str, float, float]], n: int, layers: int) -> dict:
    """µs per decode step by role (qkv, o, gate_up, down, lm_head, store, attention,
    attention reduce, other, idle): how far each kernel moved the end of the work done so
    far. Under programmatic dependent launch kernels overlap (a kernel starts while the
    one before it runs and waits inside), so their durations add up to more than the
    step; this attribution sums to the step's span instead: in the order they end, a
    kernel ending at `e` is charged e - max(E, its start), E the latest end before it,
    and a gap between E and its start (nothing running) is charged to idle. `n` steps;
    gaps over 50 µs are step boundaries (host time, not charged)."""
    names = _projection_order(layers)
    roles, k_gemv = [], 0
    for name, start, end in sorted(spans, key=lambda s: s[1]):  # launch order: GEMV roles
        if name.startswith("_gemv_kernel"):
            role = names[k_gemv % len(names)]
            k_gemv += 1
        else:
            role = next((r for key, r in _ROLES if name.lstrip("_").startswith(key)), "other")
        roles.append((role, start, end))
    out: dict[str, float] = {}
    last_end = None
    for role, start, end in sorted(roles, key=lambda s: s[2]):
        if last_end is not None and start - last_end > 50.0:
            last_end = None  # a step boundary
        if last_end is None:
            out[role] = out.get(role, 0.0) + (end - start)
            last_end = end
            continue
        if start > last_end:
            out["idle"] = out.get("idle", 0.0) + (start - last_end)
        out[role] = out.get(role, 0.0) + max(0.0, end - max(last_end, start))
        last_end = max(last_end, end)
    return {k: round(v / n, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def gemv_by_shape(prof, n: int, model) -> dict:  # noqa: ANN001
    """Per projection (qkv, o, gate_up, down, lm_head): µs per call of the fused GEMV
    kernel, its weight bytes over that time (TB/s), and the idle µs before it (the end of
    the previous kernel to its start). The launches come in model order each step: four
    per layer, then lm_head; {} when the count does not say so (e.g. torch linears)."""
    kernels = sorted((e for e in prof.events() if _is_device_kernel(e)),
                     key=lambda e: e.time_range.start)
    gaps, last_end = {}, None
    for e in kernels:
        gaps[id(e)] = e.time_range.start - last_end if last_end is not None else float("inf")
        last_end = e.time_range.end
    gemvs = [e for e in kernels if e.name.startswith("_gemv_kernel")]
    layers = model.config.num_layers
    if not gemvs or len(gemvs) != n * (4 * layers + 1):
        return {}
    names = _projection_order(layers)
    blk = model.layers[0]
    weights = {"qkv": blk.attn.wqkv.weight, "o": blk.attn.wo.weight,
               "gate_up": blk.mlp.w13.weight, "down": blk.mlp.w2.weight,
               "lm_head": model.head_weight}
    out = {}
    for name, w in weights.items():
        calls = [e for i, e in enumerate(gemvs) if names[i % len(names)] == name]
        us = sum(e.time_range.elapsed_us() for e in calls) / len(calls)
        gap = [gaps[id(e)] for e in calls if gaps[id(e)] < 50.0]  # not a step boundary
        out[name] = {"us": round(us, 2), "bytes": w.numel() * w.element_size(),
                     "TBps": round(w.numel() * w.element_size() / us / 1e6, 3),
                     "gap_before_us": round(sum(gap) / max(len(gap), 1), 2)}
    return out


def _is_device_kernel(evt) -> bool:  # noqa: ANN001
    from torch.autograd import DeviceType

    skip = ("cudaLaunch", "cuLaunch", "cudaGraph", "Memcpy", "Memset")
    return evt.device_type == DeviceType.CUDA and not evt.name.startswith(skip)


def fill_random(caches, model, ctx: int, batch: int, chunk: int = 8192) -> None:  # noqa: ANN001
    """Append `ctx` random N(0,1) K/V tokens to every layer's cache, `chunk` at a time."""
    cfg = model.config
    dev, dtype = model.embed.weight.device, model.embed.weight.dtype
    gen = torch.Generator(device=dev).manual_seed(ctx)
    for cache in caches:
        for start in range(0, ctx, chunk):
            n = min(chunk, ctx - start)
            shape = (batch, cfg.num_kv_heads, n, cfg.head_dim)
            k = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
            v = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
            cache.append(k, v)


def _time_steps(step, tok, n: int, budget_s: float) -> list[float]:  # noqa: ANN001
    """ms per decode step: CUDA events around each step on CUDA, wall clock on CPU."""
    cuda = tok.is_cuda
    t_end = time.perf_counter() + budget_s
    if not cuda:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            tok = step(tok)
            times.append(1000 * (time.perf_counter() - t0))
            if time.perf_counter() > t_end:
                break
        return times
    events = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        tok = step(tok)
        end.record()
        events.append((start, end))
        if time.perf_counter() > t_end:
            break
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def _kernel_read_ceiling() -> float:
    """Bytes/s: readceiling.py's best streaming read (CUDA graph, L2 flushed, median of 10)."""
    from readceiling import read_ceiling
    from kvtax.harness.bench.gpu_timer import Timer

    tbps, _ = read_ceiling(Timer(reps=10, dry=False, flush="read"))
    torch.cuda.empty_cache()
    return tbps * 1e12


def measure_read_bandwidth(dev: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes/s: the better of a copy ((read + write) / t) and a sum (read / t), median of reps."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    y = torch.empty_like(x)

    def timed(fn) -> float:  # noqa: ANN001
        fn()
        samples = []
        for _ in range(reps):
            if dev.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                samples.append(s.elapsed_time(e) / 1000)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    copy_bw = 2 * nbytes / timed(lambda: y.copy_(x))
    sum_bw = nbytes / timed(lambda: x.sum())
    return max(copy_bw, sum_bw)


def _weight_bytes_per_token(model) -> int:  # noqa: ANN001
    """Bytes one decode step must read: all weights, but one row of an untied embedding."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        e = model.embed.weight
        total -= e.numel() * e.element_size() - e.shape[1] * e.element_size()
    return total


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def markdown_table(rows: list[dict]) -> str:
    head = ("| context | KV | variant | ms/token (p20-p80) | roofline ms | of roofline | KV MiB "
            "| graph |\n|---:|:--|:--|---:|---:|---:|---:|:--|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['kv']} | {r.get('variant') or 'default'} | "
                         f"{r['error'][:60]} | | | | |")
            continue
        lines.append(
            f"| {r['context']} | {r['kv']} | {r.get('variant') or 'default'} | "
            f"{r['ms_median']:.3f} ({r['ms_p20']:.3f}-"
            f"{r['ms_p80']:.3f}) | {r['roofline_ms']:.3f} | {100 * r['roofline_fraction']:.0f}% | "
            f"{r['kv_bytes'] / 2**20:.1f} | {'yes' if r['cuda_graph'] else 'no'}"
            f"{' (compiled)' if r.get('compiled') else ''}"
            f"{' (triton gemv)' if r.get('gemv') == 'triton' else ''} |"
        )
    return "\n".join(lines)


def _row_line(r: dict) -> str:
    if "error" in r:
        return f"ctx {r['context']:>7} {r['kv']:>6} [{r.get('variant', '')}]: {r['error']}"
    line = (f"ctx {r['context']:>7} {r['kv']:>6}{' compiled' if r.get('compiled') else ''}"
            f"{' gemv=triton' if r.get('gemv') == 'triton' else ''}"
            f"{' [' + r['variant'] + ']' if r.get('variant') else ''}: "
            f"{r['ms_median']:.3f} ms/token, roofline "
            f"{r['roofline_ms']:.3f} ms ({100 * r['roofline_fraction']:.0f}%)")
    if "kernel_ms_per_step" in r:
        kinds = ", ".join(f"{k} {v:.3f}" for k, v in r["kernel_ms_by_kind"].items())
        line += (f"; kernels {r['kernel_ms_per_step']:.3f} ms/step ({kinds}), "
                 f"{r['launches_per_step']:.0f} launches")
    if r.get("critical_us_by_role"):
        line += "; step critical path us: " + ", ".join(
            f"{k} {v:.0f}" for k, v in r["critical_us_by_role"].items())
    if r.get("gemv_by_shape"):
        line += "; GEMV us (TB/s, gap us): " + ", ".join(
            f"{k} {v['us']:.1f} ({v['TBps']:.2f}, {v['gap_before_us']:.1f})"
            for k, v in r["gemv_by_shape"].items())
    return line


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"


def _metadata(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype, bw: float) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    if len(commit) != 40:  # not a git checkout (e.g. a copied tree)
        commit = ""
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "device": _device_name(dev),
        "dtype": str(dtype),
        "read_bw_Bps": bw,
        "torch": torch.__version__,
        "git_commit": commit,
        "timestamp": datetime.now(timezone.utc).isoformat(),
    }


if __name__ == "__main__":
    raise SystemExit(main())
