"""Where a hybrid cache's prefill chunk spends its time: the whole call, each part's kernel,
the torch merge it replaced, and the body's prefill kernel under each argument variant.

One Llama-3.1-8B layer (32 q heads, 8 KV heads, head_dim 128, batch 1, fp16), a HybridCache
of `--spec` (default q4) filled in 2048-token chunks to each context, a 2048-row chunk's
queries. Times are medians of CUDA-graph replays with L2 evicted before each
(`kvtax.harness.bench.gpu_timer.Timer`, as benchmarks/attention.py). The body variants
show how far one kernel's time moves with its arguments (device lengths, the hybrid masks,
a log-sum-exp output, the chained merge's prior), each with its registers and spills.

    python benchmarks/hybrid_prefill.py --contexts 4096 131072 --out runs/hybrid-prefill.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kvtax.attention import launch  # noqa: E402
from kvtax.attention.dispatch import attention, part_attention  # noqa: E402
from kvtax.attention.lse import merge_lse  # noqa: E402
from kvtax.cache.hybrid import HybridCache  # noqa: E402
from kvtax.harness.bench.gpu_timer import Timer, git_commit  # noqa: E402

CHUNK = 2048


def compiled_resources() -> dict:
    """Wrap the prefill kernel so each launch records (registers, spills) of its variant."""
    real, seen = launch.prefill_attn_fwd_kernel, {}

    class Recorder:
        def __getitem__(self, grid):
            def call(*a, **k):
                ck = real[grid](*a, **k)
                seen["last"] = (getattr(ck, "n_regs", None), getattr(ck, "n_spills", None))
                return ck
            return call

    launch.prefill_attn_fwd_kernel = Recorder()
    return seen


def body_variants(q: torch.Tensor, part, ctx: int) -> dict[str, dict]:
    """The body's launch_attention under each argument variant: name → its kwargs."""
    lens = torch.full((q.shape[0],), ctx, dtype=torch.int32, device=q.device)
    o32 = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    prior = (torch.zeros_like(o32), torch.zeros_like(lse))
    masks = dict(min_distance=part.min_distance, min_key=part.min_key)
    return {
        "plain": dict(), "device lengths": dict(lengths=lens), "masks": dict(masks),
        "masks + lse (float32 out)": dict(out=o32, lse=lse, **masks),
        "masks + prior": dict(prior=prior, **masks),
    }


def run(ctx: int, spec: str, timer: Timer, seen: dict) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(ctx)
    k, v = (torch.randn(1, 8, ctx, 128, generator=gen, device="cuda", dtype=torch.float16)
            for _ in range(2))
    cache = HybridCache(spec, capacity=ctx, max_chunk=CHUNK)
    for t in range(0, ctx, CHUNK):
        cache.append(k[:, :, t:t + CHUNK], v[:, :, t:t + CHUNK])
    view = cache.view()
    q = torch.randn(1, 32, min(CHUNK, ctx), 128, generator=gen, device="cuda",
                    dtype=torch.float16)
    parts = [part_attention(q, p) for p in view.parts]
    want = merge_lse(parts)[0]
    err = (attention(q, view).float() - want).abs().max().item()
    row = dict(ctx=ctx, spec=spec, max_abs_diff_vs_merge=err,
               whole_ms=timer(lambda: attention(q, view))[0],
               merge_ms=timer(lambda: merge_lse(parts)[0].to(q.dtype))[0])
    for p in view.parts:
        row[f"part {p.view.spec.name} (float32 + lse) ms"] = timer(
            lambda p=p: part_attention(q, p))[0]
    body = max(view.parts, key=lambda p: p.view.num_slots)
    for name, kw in body_variants(q, body, ctx).items():
        f = lambda kw=kw: launch.launch_attention(q, body.view, **kw)  # noqa: E731
        f()
        row[f"body {name} ms"] = timer(f)[0]
        row[f"body {name} regs/spills"] = seen.get("last")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 131072])
    p.add_argument("--spec", default="q4")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("hybrid_prefill.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    seen = compiled_resources()
    timer = Timer(args.reps, dry=False)
    rows = []
    for ctx in args.contexts:
        rows.append(run(ctx, args.spec, timer, seen))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(
            meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                      git_commit=git_commit(), command=" ".join(sys.argv)), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
