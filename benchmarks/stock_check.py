"""Stock torch attention in the same captured decode step as kvtax's: ms/token per arm (GPU).

One model (default Llama-3.1-8B shapes, bf16, random weights), one `Runner` configuration
for every arm (CUDA-graph greedy decode, the fused GEMVs where the runner turns them on):
the arms differ only in the attention function and the cache's storage. As in decode.py,
the cache is filled directly with random K/V to each context (N(0, 1), stored as a prefill
would store it), then real model steps are timed (CUDA events, median and p20/p80).

Arms (`--arms`, default all):
  kvtax-fp16 / kvtax-int8   kvtax's fused kernels
  sdpa             torch SDPA over the fp16 storage, captured: a masked call over the
                   presized capacity (lengths from the device), query heads kept
                   (enable_gqa), torch's backend choice: the bench's stock fp16 arm
  sdpa-efficient / sdpa-cudnn / sdpa-flash / sdpa-math   the same call, backend pinned
                   (flash takes no mask: it is expected to fail, as a row, in this form)
  sdpa-folded / sdpa-cudnn-folded   the masked call with each KV head's query group
                   folded into query rows rather than enable_gqa
  sdpa-varlen      torch's flash varlen attention over exactly the held keys (device
                   lengths via seqused_k), captured
  sdpa-eager       the host-length SDPA call with eager decode (the old stock arm)
  dequant-int8     transformers' way: dequantize all the storage every step, masked SDPA
  unfused-int8     mlx-lm's way: materialized scores over the storage, masked softmax

Every row names the SDPA backend torch dispatched to and whether decode replayed a graph,
and checks its first step's logits against kvtax-fp16's at that context (same cache
contents and token): fp16 arms must agree to bf16 noise (rel RMS < 0.05), int8 arms show
their quantization error (the check is informational for them).

    python benchmarks/stock_check.py --out $OUT/stock_check.json       # ~1-2 min on an H200
    python benchmarks/stock_check.py --device cpu --config tiny --contexts 64,300 --tokens 4
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtax.attention.baselines import ATTENTION_PATHS, attention_sdpa_folded
from kvtax.attention.varlen import attention_sdpa_varlen
from kvtax.cli.validate import parse_contexts
from kvtax.harness.bench.cells import decode_sdpa_backend
from kvtax.harness.bench.decode_timing import (  # the same fill, timing, metadata as decode.py
    DTYPES, device_name, fill_random, quantile, run_metadata, time_steps)
from kvtax.harness.bench.hooks import use_attention, use_sdpa_backend
from kvtax.models import Runner, get_config, load_model


@dataclass(frozen=True)
class Arm:
    name: str
    path: str            # the bench path it stands for (fused, fp16, dequant, unfused)
    kv: str
    backend: str = "auto"
    graph: bool = True
    varlen: bool = False
    fold_gqa: bool = False  # True: GQA folded into query rows under one mask


ARMS = {a.name: a for a in (
    Arm("kvtax-fp16", "fused", "fp16"),
    Arm("sdpa", "fp16", "fp16"),
    Arm("sdpa-efficient", "fp16", "fp16", backend="efficient"),
    Arm("sdpa-cudnn", "fp16", "fp16", backend="cudnn"),
    Arm("sdpa-folded", "fp16", "fp16", fold_gqa=True),
    Arm("sdpa-cudnn-folded", "fp16", "fp16", backend="cudnn", fold_gqa=True),
    Arm("sdpa-varlen", "fp16", "fp16", varlen=True),
    Arm("sdpa-eager", "fp16", "fp16", graph=False),
    Arm("kvtax-int8", "fused", "int8"),
    Arm("dequant-int8", "dequant", "int8"),
    Arm("unfused-int8", "unfused", "int8"),
    Arm("sdpa-flash", "fp16", "fp16", backend="flash"),
    Arm("sdpa-math", "fp16", "fp16", backend="math"),
)}
DEFAULT_ARMS = list(ARMS)[:11]  # flash (no mask) and math: ask for them by name
FP16_TOL = 0.05  # rel RMS of logits between fp16-KV arms: bf16 model, different kernels


# Arms that call torch ops less travelled than SDPA's defaults; they run after all others,
# so a device fault that poisons the CUDA context costs only them.
LATE = ("sdpa-varlen", "sdpa-cudnn", "sdpa-cudnn-folded", "sdpa-flash", "sdpa-math")


def plan(arms: list[str], contexts: list[int]) -> list[tuple[int, str]]:
    """(context, arm) cells in run order: kvtax-fp16 first at each context (the others'
    logits reference), then the arms as given, the LATE ones after every context's rest."""
    names = sorted(dict.fromkeys(arms), key=lambda a: a != "kvtax-fp16")
    early = [a for a in names if a not in LATE]
    late = [a for a in names if a in LATE]
    return [(c, a) for c in contexts for a in early] + [(c, a) for c in contexts for a in late]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama-3.1-8b", help="built-in config (default "
                   "llama-3.1-8b)")
    p.add_argument("--contexts", default="4k,32k,128k",
                   help="cached tokens before timing; k = 1024 (default 4k,32k,128k)")
    p.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS),
                   help=f"arms to time (default: {' '.join(DEFAULT_ARMS)})")
    p.add_argument("--tokens", type=int, default=24, help="timed decode steps (default 24)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weight dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every arm's step before capture (slow to start)")
    p.add_argument("--max-cell-seconds", type=float, default=10.0,
                   help="stop timing a cell after this long, in s (default 10)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no cell after this many seconds; later cells become rows "
                        "with status skipped (default: no budget)")
    p.add_argument("--out", type=Path, default=None, help="write rows + metadata as JSON")
    return p.parse_args(argv)


def run_arm(model, arm: Arm, ctx: int, args: argparse.Namespace) -> dict:  # noqa: ANN001
    """Fill a cache to `ctx`, take one checked step (logits), then time greedy steps."""
    dev, cfg = model.embed.weight.device, model.config
    if args.compile:
        torch._dynamo.reset()
    fn = (attention_sdpa_varlen if arm.varlen else
          attention_sdpa_folded if arm.fold_gqa else ATTENTION_PATHS[arm.path])
    runner = Runner(model, kv=arm.kv, cuda_graph=None if arm.graph else False,
                    compile=args.compile and arm.graph)
    caches = runner.make_caches(capacity=ctx + args.warmup + args.tokens + 3)
    try:
        with use_attention(model, fn), use_sdpa_backend(arm.backend), torch.inference_mode():
            fill_random(caches, model, ctx, 1, chunk=runner.chunk_size)
            kv_bytes = sum(c.used_nbytes for c in caches)
            tok = torch.full((1, 1), 7, dtype=torch.long, device=dev)
            logits = runner.decode_step(tok, caches).float()
            graph = bool(runner.cuda_graph and runner.graph_disabled_reason is None)
            if arm.varlen and dev.type == "cuda" and not graph:  # eager would be plain sdpa
                raise RuntimeError(f"not captured: {runner.graph_disabled_reason}")
            backend = _backend(arm, caches, cfg, model.embed.weight.dtype, graph)
            step = lambda t: runner.decode_greedy(t, caches)  # noqa: E731
            tok = logits.argmax(-1, keepdim=True)
            for _ in range(args.warmup):
                tok = step(tok)
            times = time_steps(step, tok, args.tokens, args.max_cell_seconds)
            graph = graph and runner.graph_disabled_reason is None
        return {"logits": logits, "kv_bytes": kv_bytes, "ms_median": statistics.median(times),
                "ms_p20": quantile(times, 0.2), "ms_p80": quantile(times, 0.8),
                "steps": len(times), "cuda_graph": graph, "sdpa_backend": backend,
                "graph_off_reason": runner.graph_disabled_reason}
    finally:
        runner.release_graph()


def _backend(arm: Arm, caches, cfg, dtype, graph: bool) -> str | None:  # noqa: ANN001
    """What computed attention: kvtax's kernels, flash varlen, or the SDPA backend torch
    dispatched the arm's call to (asked under the same pinned backends)."""
    if arm.path == "fused":
        return "kvtax"
    if arm.varlen and graph:
        return "flash-varlen"
    name = decode_sdpa_backend(arm.path, caches, cfg, dtype, graph, arm.fold_gqa)
    return name or "matmul-softmax"


def check(row: dict, logits: torch.Tensor, ref: torch.Tensor | None) -> None:
    """Logits of the arm's first step against kvtax-fp16's: rel RMS, max abs, verdict."""
    if ref is None:
        return
    diff = (logits - ref).double()
    rel = (diff.pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt().clamp_min(1e-30))
    row["logits_rel_rms"] = float(rel)
    row["logits_max_abs"] = float(diff.abs().max())
    row["check"] = ("ok" if rel < FP16_TOL else "FAIL") if row["kv"] == "fp16" else "info"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    cfg = get_config(args.config)
    t_start = time.perf_counter()
    model = load_model(cfg, dtype=dtype, device=dev, seed=0)
    print(f"# {cfg.name} ({dtype}) on {device_name(dev)}, torch {torch.__version__}",
          file=sys.stderr)
    rows, refs = [], {}
    for ctx, name in plan(args.arms, parse_contexts(args.contexts)):
        arm = ARMS[name]
        row = {"arm": name, "path": arm.path, "kv": arm.kv, "context": ctx,
               "sdpa_pinned": arm.backend, "config": cfg.name, "dtype": str(dtype),
               "device": device_name(dev), "compiled": bool(args.compile and arm.graph)}
        if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            row.update(status="skipped", error=f"past --budget-s {args.budget_s:g}")
        else:
            try:
                res = run_arm(model, arm, ctx, args)
                logits = res.pop("logits")
                row.update(status="ok", **res)
                if name == "kvtax-fp16":
                    refs[ctx] = logits
                check(row, logits, refs.get(ctx))
            except Exception as exc:  # one arm failing must not end the run
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
            gc.collect()  # the arm's caches and graph pools, before the next arm allocates
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(_line(row), file=sys.stderr, flush=True)
        if args.out:
            _write(args, dev, dtype, rows)
    order = {name: i for i, name in enumerate(dict.fromkeys(args.arms))}
    rows.sort(key=lambda r: (r["context"], order[r["arm"]]))
    print(markdown(rows))
    # the run failed when an fp16 arm disagrees, or kvtax's or the stock arm did not run
    failed = [r for r in rows if r.get("check") == "FAIL"
              or (r["arm"] in ("kvtax-fp16", "sdpa") and r["status"] == "error")]
    return 1 if failed else 0


def _write(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype,
           rows: list[dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps({"meta": run_metadata(args, dev, dtype, 0.0), "rows": rows},
                              indent=1))
    tmp.replace(args.out)


def _line(r: dict) -> str:
    head = f"ctx {r['context']:>7} {r['arm']:>15}: "
    if r["status"] != "ok":
        return head + f"{r['status']}: {r.get('error', '')}"
    rel = r.get("logits_rel_rms")
    return head + (f"{r['ms_median']:.3f} ms/token ({r['ms_p20']:.3f}-{r['ms_p80']:.3f}), "
                   f"graph {'yes' if r['cuda_graph'] else 'no'}, attention {r['sdpa_backend']}"
                   + (f", logits rel RMS {rel:.2e} [{r['check']}]" if rel is not None else "")
                   + (f"; eager: {r['graph_off_reason']}" if r.get("graph_off_reason") else ""))


def markdown(rows: list[dict]) -> str:
    """One table: per context and arm, decode ms/token, graph, backend, logits check."""
    lines = ["| context | arm | ms/token (p20-p80) | vs kvtax-fp16 | graph | attention "
             "| logits rel RMS |", "|---:|:--|---:|---:|:--|:--|:--|"]
    base = {r["context"]: r["ms_median"] for r in rows
            if r["arm"] == "kvtax-fp16" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['context']} | {r['arm']} | {r['status']}: "
                         f"{r.get('error', '')[:70]} | | | | |")
            continue
        ratio = (f"{r['ms_median'] / base[r['context']]:.2f}x" if r["context"] in base
                 else "")
        rel = r.get("logits_rel_rms")
        lines.append(
            f"| {r['context']} | {r['arm']} | {r['ms_median']:.3f} ({r['ms_p20']:.3f}-"
            f"{r['ms_p80']:.3f}) | {ratio} | {'yes' if r['cuda_graph'] else 'no'} | "
            f"{r['sdpa_backend']} | "
            + (f"{rel:.1e} {r['check']}" if rel is not None else "") + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
