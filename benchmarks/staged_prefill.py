"""Staged prefill (kvtax.attention.staged) against the fused kernel over quantized storage,
per format, context and prefill-chunk rows: where staging pays, and by how much.

One Llama-3.1-8B layer (32 q heads, 8 KV heads, head_dim 128, batch 1, fp16). Each
format's cache (plain, or a HybridCache for `@` specs such as q4) is filled in 2048-token
chunks to each context; `attention(q, view)` of the last L rows is timed staged
(STAGE_MIN_ROWS 0) and fused (staging off), with kvtax over an fp16 cache and SDPA's
FlashAttention-2 beside them. Medians of CUDA-graph replays with L2 evicted before each
(`kvtax.harness.bench.gpu_timer.Timer`, read flush, as benchmarks/attention.py); TFLOP/s counts the
causal bottom-right multiply-adds; `transient MiB` is the call's peak allocation beyond
its output; `max |staged - fused|` compares the two outputs.

    python benchmarks/staged_prefill.py --contexts 4096 32768 131072 --rows 256 512 2048 \\
        --out runs/staged-prefill.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kvtax.attention import staged  # noqa: E402
from kvtax.attention.baselines import attention_sdpa  # noqa: E402
from kvtax.attention.dispatch import attention  # noqa: E402
from kvtax.cache import FullCache  # noqa: E402
from kvtax.cache.hybrid import HybridCache  # noqa: E402
from kvtax.harness.bench.gpu_timer import Timer, git_commit  # noqa: E402

STEP = 2048
DEFAULT_MIN_ROWS = staged.STAGE_MIN_ROWS
H_Q, H_KV, D = 32, 8, 128


def flops(n_q: int, ctx: int) -> float:
    """QK^T and PV multiply-adds of causal bottom-right attention (2 FLOPs each)."""
    return 4.0 * H_Q * D * (n_q * ctx - n_q * (n_q - 1) / 2)


def filled(spec: str, ctx: int, k: torch.Tensor, v: torch.Tensor):
    cache = (HybridCache(spec, capacity=ctx, max_chunk=STEP) if "@" in spec or spec in ("q4", "q3")
             else FullCache(spec, capacity=ctx))
    for t in range(0, ctx, STEP):
        cache.append(k[:, :, t:t + STEP], v[:, :, t:t + STEP])
    return cache.view()


def peak(fn) -> tuple[float, torch.Tensor]:
    """(MiB allocated at the peak of one call beyond what it returns, its output)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    return extra / 2**20, out


def mode(rows: int):
    """staged.STAGE_MIN_ROWS for 'staged' (0: always) or 'fused' (never)."""
    staged.STAGE_MIN_ROWS = rows


def run(ctx: int, specs: list[str], row_counts: list[int], timer: Timer) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(ctx)
    k, v = (torch.randn(1, H_KV, ctx, D, generator=gen, device="cuda", dtype=torch.float16)
            for _ in range(2))
    views = {s: filled(s, ctx, k, v) for s in ["fp16", *specs]}
    del k, v
    out = []
    for n_q in row_counts:
        q = torch.randn(1, H_Q, n_q, D, generator=gen, device="cuda", dtype=torch.float16)
        tf = flops(n_q, ctx) / 1e9
        base = dict(ctx=ctx, rows=n_q)
        fp16 = views["fp16"]
        ms = timer(lambda: attention(q, fp16))[0]
        out.append(dict(base, arm="kvtax-fp16", ms=ms, tflops=tf / ms))
        ms = timer(lambda: attention_sdpa(q, fp16, lower_right=True))[0]
        out.append(dict(base, arm="sdpa-flash", ms=ms, tflops=tf / ms))
        for spec in specs:
            view = views[spec]
            res = {}
            for name, rows in (("fused", 2**62), ("staged", 0)):
                mode(rows)
                mib, res[name] = peak(lambda: attention(q, view))
                ms = timer(lambda: attention(q, view))[0]
                out.append(dict(base, arm=f"{spec} {name}", ms=ms, tflops=tf / ms,
                                transient_mib=round(mib, 1)))
            out[-1]["max |staged - fused|"] = (res["staged"].float() - res["fused"].float()
                                               ).abs().max().item()
            mode(DEFAULT_MIN_ROWS)
        for r in out[-2 - 2 * len(specs):]:
            print(json.dumps(r), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 512, 2048])
    p.add_argument("--specs", nargs="+", default=["int8", "int4", "k4-c64v4", "q4"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("staged_prefill.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    timer = Timer(args.reps, dry=False, flush="read")
    rows = []
    for ctx in args.contexts:
        rows += run(ctx, args.specs, args.rows, timer)
        torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(
            meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                      git_commit=git_commit(), command=" ".join(sys.argv),
                      stage_bytes=staged.STAGE_BYTES), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
