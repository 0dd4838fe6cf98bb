"""How far the fused kernels' attention is from the float32 reference, and from another
source tree's kernels, on the same inputs: a 2048-row prefill chunk and one decode row
over a cache of `--contexts` tokens written in 2048-token chunks, Qwen2.5-0.5B's shape
(head_dim 64, 2 KV heads, 7 queries per KV head) with keys carrying a per-channel
offset and four outlier channels, queries in float32 (a float32 model's).

Why: a 4-bit cache's recall answers can change when the kernels' rounding changes (a
different quantization code where a key sits at a rounding boundary changes every
later layer); this says how large a rounding change between two commits is.

    python benchmarks/kernel_rounding.py --out runs/rounding --tag new
    python benchmarks/kernel_rounding.py --src /path/to/old/src --out runs/rounding \
        --tag old --against new

Prints, per format and context, the relative RMS error of `attention` against
`attention(impl="reference")` (both over the same stored cache), and with `--against`
the relative RMS difference from that tag's saved outputs. CPU runs the reference only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

D, KV_HEADS, GROUP, CHUNK = 64, 2, 7, 2048


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", help="a source tree to import kvtax from (default: installed)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--kv", default="k4-c64v4@s4r128,k4-c64v4", help="comma-separated formats")
    ap.add_argument("--out", required=True, help="folder for <tag>-<context>.pt")
    ap.add_argument("--tag", required=True)
    ap.add_argument("--against", help="a tag saved earlier in --out to compare with")
    args = ap.parse_args(argv)
    out = Path(args.out)
    missing = [str(out / f"{args.against}-{c}.pt") for c in args.contexts
               if args.against and not (out / f"{args.against}-{c}.pt").is_file()]
    if missing or min(args.contexts) < 1:
        why = f"no saved outputs {', '.join(missing)}" if missing else "contexts must be >= 1"
        print(f"kernel_rounding: {why}", file=sys.stderr)
        return 2
    if args.src:
        sys.path.insert(0, args.src)
    try:
        return run(args, out)
    except (ValueError, RuntimeError) as e:  # kvtax's errors (an unknown format) among them
        print(f"kernel_rounding: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for ctx in args.contexts:
        res = outputs(ctx, args.kv.split(","))
        torch.save(res, out / f"{args.tag}-{ctx}.pt")
        for name in (k for k in res if not k.endswith("_ref")):
            ref = res[name + "_ref"]
            print(f"{args.tag} {ctx} {name} rel rms {rel(res[name], ref):.3e}", flush=True)
        if args.against:
            other = torch.load(out / f"{args.against}-{ctx}.pt")
            for name in res:
                print(f"{ctx} {name} {args.tag} vs {args.against} rel "
                      f"{rel(res[name], other[name]):.3e}", flush=True)
    return 0


def outputs(ctx: int, specs: list[str]) -> dict:
    """name → output `[1, 14, L, 64]` float32 on CPU, for the prefill chunk and the decode
    row of each format, by the kernels (auto) and by the reference. kvtax is imported
    here, after main() has put `--src` first on the path."""
    from kvtax.attention import attention
    from kvtax.cache.policy import make_caches

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    scale_c = torch.ones(D)
    scale_c[[3, 35, 17, 49]] = torch.tensor([12.0, 12.0, 6.0, 6.0])  # outlier channels
    offset = torch.randn(D, generator=g) * 2.0  # a per-channel key offset, as Qwen's

    def keys(n: int) -> torch.Tensor:
        return torch.randn(1, KV_HEADS, n, D, generator=g) * scale_c + offset

    res = {}
    for spec in specs:
        g.manual_seed(1)
        cache = make_caches([None], spec)[0]
        n = m = 0
        while n < ctx:
            m = min(CHUNK, ctx - n)
            cache.append(keys(m).to(dev), torch.randn(1, KV_HEADS, m, D, generator=g).to(dev))
            n += m
        for phase, rows in (("prefill", m), ("decode", 1)):
            if phase == "decode":
                cache.append(keys(1).to(dev), torch.randn(1, KV_HEADS, 1, D, generator=g).to(dev))
            q = (torch.randn(1, KV_HEADS * GROUP, rows, D, generator=g) * scale_c / 4).to(dev)
            view = cache.view()
            res[f"{spec}/{phase}"] = attention(q, view).float().cpu()
            res[f"{spec}/{phase}_ref"] = attention(q, view, impl="reference").float().cpu()
    return res


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    # attention.py's rel_err, not imported: that module imports kvtax, before --src applies
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


if __name__ == "__main__":
    raise SystemExit(main())
