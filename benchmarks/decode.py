"""Decode ms/token of the kvtax runner against the bytes roofline, per context and KV format.

A batch-1 decode step must read every weight once and the whole KV cache once, so its floor
is (weight bytes + KV bytes) / memory read bandwidth. This script measures that bandwidth in
the same run (a large device copy and a large reduction; the faster one counts, so the
roofline is the stricter one), builds a model with random weights (default Llama-3.1-8B
shapes in bf16), and for each context and KV format times real decode steps of the model
(CUDA-graph replay where available; median and p20/p80 over --tokens steps, CUDA events;
the mean and the slowest step too: a block-quantized key (q4) writes its block at one step
in 64).
A timed step is the runner's greedy step (`Runner.decode_greedy`: the argmax inside the
graph, which feeds its own next replay); `--step logits` (or the variant `step.greedy=0`)
times `decode_step` (logits out of the graph) then `sample` instead.

`--variants` times launch overrides side by side in one process, each a cell of its own:
a variant is kvtax.models.launch.DecodeLaunch's syntax (GEMV fields per projection,
forced decode-attention keywords) plus `step.greedy=0|1` and `store.blocks=0|1` (0: a
block-quantized key cache (q4's body) writes through torch, not its fused kernel,
kvtax.formats.block_store_triton). PDL off is a second run with the environment variable
KVTAX_PDL=0.

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
import statistics
import sys
from pathlib import Path

import torch

from kvtax.cli.validate import parse_contexts
from kvtax.errors import OptionError
from kvtax.formats.channel import ChannelBlockFormat
from kvtax.harness.bench.decode_timing import (
    DTYPES, device_name, fill_random, kernel_read_ceiling, measure_read_bandwidth, quantile,
    run_metadata, time_steps, weight_bytes_per_token)
from kvtax.harness.bench.step_profile import kernel_breakdown
from kvtax.models import Runner, get_config, load_model
from kvtax.models.launch import DecodeLaunch
from kvtax.models.sampling import sample  # greedy: the one-launch argmax


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default="llama-3.1-8b",
                   help="built-in config (default llama-3.1-8b)")
    p.add_argument("--contexts", default="4k,16k,32k,64k,128k", type=parse_contexts,
                   help="cached tokens before timing; k = 1024 (default 4k,16k,32k,64k,128k)")
    p.add_argument("--kv", default="fp16,int8,int4", help="KV formats (default fp16,int8,int4)")
    p.add_argument("--tokens", type=int, default=64,
                   help="timed decode steps per cell (default 64)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (default 8)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
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
                        "block_k, split_k, fold), e.g. block_k=1024; "
                        "the same as --variants gemv.FIELD=V,...")
    p.add_argument("--variants", default="", metavar="V;V...",
                   help="launch variants, ';'-separated, each timed as its own cell in this "
                        "process: comma-separated SCOPE.FIELD=INT with SCOPE gemv, a "
                        "projection (qkv, o, gate_up, down, lm_head) or attn (the decode "
                        "attention launch: per_sm, num_stages, ...) (kvtax.models.launch), "
                        "or step.greedy=0|1; an empty variant is the defaults")
    p.add_argument("--out", type=Path, default=None, help="write rows + run metadata as JSON")
    return p.parse_args(argv)


def variant_list(args: argparse.Namespace) -> list[tuple[str, DecodeLaunch, bool, bool]]:
    """(text, launch overrides, greedy step, fused block-key writes) of each variant to
    time, checked up front; a bad one exits 2 with a one-line error."""
    if args.gemv_override and args.variants:
        _bad_input("give --gemv-override or --variants, not both")
    if args.gemv_override:
        texts = [",".join(f"gemv.{t.strip()}" for t in args.gemv_override.split(",")
                          if t.strip())]
    else:
        texts = [t.strip() for t in args.variants.split(";")] if args.variants else [""]
    out = []
    for text in texts:
        items = [t.strip() for t in text.split(",") if t.strip()]
        step = [t for t in items if t.startswith(("step.", "store."))]
        greedy, blocks = args.step == "greedy", True
        for item in step:
            if item in ("step.greedy=0", "step.greedy=1"):
                greedy = item.endswith("1")
            elif item in ("store.blocks=0", "store.blocks=1"):
                blocks = item.endswith("1")
            else:
                _bad_input(f"variant item {item!r}: step.greedy=0|1 or store.blocks=0|1")
        try:
            launch = DecodeLaunch.parse(",".join(t for t in items if t not in step))
        except OptionError as exc:
            _bad_input(str(exc))
        if launch.attention and args.compile != "off":
            _bad_input("attn.* variants launch the attention kernels uncompiled: no --compile")
        out.append((text, launch, greedy, blocks))
    return out


def _bad_input(message: str) -> None:
    print(f"decode.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    variants = variant_list(args)
    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    cfg = get_config(args.config)
    contexts, formats = args.contexts, [f.strip() for f in args.kv.split(",")]
    torch_bw = measure_read_bandwidth(dev, (args.bw_mib or (4096 if dev.type == "cuda" else 256))
                                      << 20)
    # The roofline divides by the best read rate this GPU showed in the run: torch's copy /
    # sum, or attention.py's streaming-read kernels (4.44-4.52 TB/s on the H200 where torch
    # measured 4.21-4.43 from call to call: the lower figure would flatter every row).
    kernel_bw = kernel_read_ceiling() if dev.type == "cuda" else 0.0
    bw = max(torch_bw, kernel_bw)
    print(f"# {cfg.name} ({dtype}) on {device_name(dev)}: read bandwidth {bw / 1e9:.0f} GB/s "
          f"(torch copy/sum {torch_bw / 1e9:.0f}, read kernels {kernel_bw / 1e9:.0f})",
          file=sys.stderr)
    model = load_model(cfg, dtype=dtype, device=dev, seed=0)
    weight_bytes = weight_bytes_per_token(model)
    rows = []
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    cells = [(ctx, kv, c, v) for ctx in contexts for kv in formats for c in compiles
             for v in variants]
    for ctx, kv, compiled, (variant, launch, greedy, blocks) in cells:
        row = {"config": cfg.name, "context": ctx, "kv": kv, "batch": args.batch,
               "dtype": str(dtype), "device": device_name(dev),
               "weight_bytes": weight_bytes, "read_bw_Bps": bw, "compiled": compiled,
               "gemv": args.gemv, "variant": variant,
               "step": "greedy" if greedy else "logits"}
        try:
            row.update(run_cell(model, kv, ctx, args, compiled, greedy, launch, blocks))
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
    meta = run_metadata(args, dev, dtype, bw)
    meta.update(read_bw_torch_Bps=torch_bw, read_bw_kernels_Bps=kernel_bw)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    tmp.replace(args.out)


def run_cell(model, kv: str, ctx: int, args: argparse.Namespace,  # noqa: ANN001
             compiled: bool = False, greedy: bool = True,
             launch: DecodeLaunch | None = None, fused_blocks: bool = True) -> dict:
    """Fill a cache to `ctx` tokens with random K/V, then time real decode steps (greedy:
    Runner.decode_greedy; else decode_step and sample) launched with `launch`'s
    overrides; fused_blocks False: block-quantized key caches write through torch."""
    dev = model.embed.weight.device
    if compiled:
        torch._dynamo.reset()  # a fresh trace per cell: new caches, no recompile limit hit
    runner = Runner(model, kv=kv, cuda_graph=False if args.no_cuda_graph else None,
                    fused_gemv={"auto": None, "torch": False, "triton": True}[args.gemv],
                    compile=compiled, launch=launch)
    caches = runner.make_caches(capacity=ctx + args.warmup + args.tokens + args.profile + 2)
    if not fused_blocks:
        for part in (p for c in caches for p in getattr(c, "parts", [c])):
            if isinstance(part.spec.key, ChannelBlockFormat):
                part.fused_store = False
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
        times = time_steps(step, tok, args.tokens, args.max_cell_seconds)
        prof = kernel_breakdown(runner, step, tok, args.profile, greedy) if args.profile else {}
        return {
            **prof,
            "kv_bytes": kv_bytes,
            "cache_bytes": sum(c.nbytes for c in caches),
            "ms_median": statistics.median(times),
            "ms_p20": quantile(times, 0.2),
            "ms_p80": quantile(times, 0.8),
            # a block-quantized key's block is written at one step in 64: the mean has it
            "ms_mean": statistics.fmean(times),
            "ms_max": max(times),
            "steps": len(times),
            "cuda_graph": runner.graph_captured(greedy),
            "graph_off_reason": runner.graph_disabled_reason,
            "gemv": "triton" if runner.fused_gemv else "torch",  # what --gemv auto chose
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        }
    finally:
        runner.release_graph()
        del caches


def _stepper(runner: Runner, caches, greedy: bool):  # noqa: ANN001, ANN202
    """token ids `[B, 1]` → the next ones: one decode step as the cell times it."""
    if greedy:
        return lambda tok: runner.decode_greedy(tok, caches)
    return lambda tok: sample(runner.decode_step(tok, caches))


def markdown_table(rows: list[dict]) -> str:
    head = ("| context | KV | variant | ms/token (p20-p80) | mean / max | roofline ms | of "
            "roofline | KV MiB | graph |\n|---:|:--|:--|---:|---:|---:|---:|---:|:--|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['kv']} | {r.get('variant') or 'default'} | "
                         f"{r['error'][:60]} | | | | | |")
            continue
        lines.append(
            f"| {r['context']} | {r['kv']} | {r.get('variant') or 'default'} | "
            f"{r['ms_median']:.3f} ({r['ms_p20']:.3f}-"
            f"{r['ms_p80']:.3f}) | {r['ms_mean']:.3f} / {r['ms_max']:.3f} | "
            f"{r['roofline_ms']:.3f} | {100 * r['roofline_fraction']:.0f}% | "
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


if __name__ == "__main__":
    raise SystemExit(main())
