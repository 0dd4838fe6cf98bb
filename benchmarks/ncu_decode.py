"""One decode attention call over a long cache, for Nsight Compute (counters, stall reasons).

    ncu --clock-control none --kernel-name regex:_decode_ --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python benchmarks/ncu_decode.py --kv int8

Builds a Llama-3.1-8B layer's cache (8 KV heads, head_dim 128, batch 1) of --context random
tokens in --kv, then runs kvtax's decode attention --calls times (the first ones compile).
"""

from __future__ import annotations

import argparse

import torch

from kvtax.attention.triton_api import triton_attention
from kvtax.cache import FullCache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv", default="int8")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--calls", type=int, default=4)
    args = p.parse_args()
    cache = FullCache(args.kv, capacity=args.context)
    for start in range(0, args.context, 8192):
        k = torch.randn(1, 8, min(8192, args.context - start), 128, device="cuda",
                        dtype=torch.bfloat16)
        cache.append(k, torch.randn_like(k))
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.calls):
        triton_attention(q, cache.view())
    torch.cuda.synchronize()
    print(f"{args.kv} decode over {args.context} tokens: {args.calls} calls done")


if __name__ == "__main__":
    main()
