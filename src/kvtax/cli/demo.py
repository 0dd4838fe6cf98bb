"""`kvtax demo`: quantize a synthetic KV cache in every format and show what it saves.

Self-contained (random K/V with a few outlier key channels, as real keys have), runs on
CPU in seconds: prints resident bytes per format against fp16 and the attention error
of the blockwise reference against fp16-KV attention.
"""

from __future__ import annotations

import argparse

import torch

from kvtax.attention import attention
from kvtax.cache import FullCache, make_caches
from kvtax.cache.base import BaseCache
from kvtax.cli.options import add_threads
from kvtax.cli.validate import at_least
from kvtax.errors import OptionError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="quantize a synthetic cache in each format: bytes saved and attention error",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--context", type=at_least(1), default=4096,
                   help="cached tokens (default 4096)")
    p.add_argument("--queries", type=at_least(1), default=16,
                   help="query rows at the end (default 16)")
    p.add_argument("--heads", default="32/8",
                   help="query/KV heads, query a multiple of KV (default 32/8)")
    p.add_argument("--head-dim", type=at_least(1), default=128, help="head dim (default 128)")
    p.add_argument(
        "--formats",
        default="fp16,q8,int8,int4,q4,fp8,k8v4",
        help="comma-separated KV formats or short names (default fp16,q8,int8,int4,q4,fp8,k8v4)",
    )
    p.add_argument("--seed", type=int, default=0, help="random K/V/q seed (default 0)")
    add_threads(p)
    p.set_defaults(func=run)


def _heads(text: str) -> tuple[int, int]:
    hq, sep, hkv = text.partition("/")
    if not (sep and hq.isdigit() and hkv.isdigit() and int(hkv) > 0 and int(hq) % int(hkv) == 0):
        raise OptionError(f"--heads takes QUERY/KV head counts like 32/8 (query a multiple of "
                          f"KV), not {text!r}")
    return int(hq), int(hkv)


def run(args: argparse.Namespace) -> int:
    from kvtax.cli.validate import check_formats, set_threads
    from kvtax.harness.bench.plan import resolve_kv

    hq, hkv = _heads(args.heads)
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    check_formats(names, "--formats", hybrid=True)
    # Default group sizes fitted to head_dim; an explicit misfit is refused before the header.
    specs = [resolve_kv(name, args.head_dim, "--formats") for name in names]
    set_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    shape = (1, hkv, args.context, args.head_dim)
    k = torch.randn(shape, generator=g)
    k[..., :4] *= 8.0  # outlier channels: real keys carry a few large ones
    v = torch.randn(shape, generator=g)
    q = torch.randn(1, hq, args.queries, args.head_dim, generator=g)
    k, v, q = k.half(), v.half(), q.half()

    ref = _run(FullCache("fp16"), k, v, q)
    print(f"context {args.context}, heads {hq}/{hkv}, head_dim {args.head_dim}, "
          f"{args.queries} query rows; error vs fp16-KV attention")
    w = max(10, *(len(s.name) + 1 for s in specs))
    print(f"{'format':<{w}}{'bytes':>12}{'vs fp16':>9}{'max abs err':>13}{'rel rms err':>13}")
    for spec in specs:
        (cache,) = make_caches([None], spec, capacity=args.context)  # q4: a HybridCache
        out = _run(cache, k, v, q)
        fp16_bytes = 2 * 2 * k.numel()
        err = (out.float() - ref.float())
        rel = err.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()
        print(f"{cache.spec.name:<{w}}{cache.used_nbytes:>12,}{fp16_bytes / cache.used_nbytes:>8.2f}x"
              f"{err.abs().max().item():>13.2e}{rel.item():>13.2e}")
    return 0


def _run(cache: BaseCache, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    cache.append(k, v)
    return attention(q, cache.view())
