"""How fast can decode's access pattern be read at all? A read-only twin of decode_warp.py.

The quantized decode kernels reach 45-70% of the streaming-read ceiling while fp16 reaches
90% (docs/KERNELS.md). Besides the codes, a quantized tile reads four small metadata
runs (K scales, K biases, V scales, V biases: 128 B each for a 32-slot int8 g64 tile)
from four other arrays. This benchmark reads exactly that pattern with the same grid
(one-warp programs, `per_sm` per SM, one split of slots each, the tiles pipelined through
shared memory) and does nothing with the bytes but a checksum, so any shortfall against
the ceiling belongs to the pattern, not to attention's arithmetic.

Layouts (`--layouts`):
  codes      K and V codes only (no metadata; the fp16 case when row = 256 B)
  split      codes + the four metadata arrays of the current cache (kvtax.cache)
  pair       codes + scale/bias interleaved: one metadata array per K and per V
  paged      each tile's metadata stored right after its codes (one stream per K, V)

    python benchmarks/read_pattern.py --context 131072 --rows 128 64 256 --order contiguous strided

Prints one line per (row bytes, layout): ms, TB/s of bytes read, % of the ceiling.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

LAYOUTS = ("codes", "split", "pair", "paged")


@triton.jit
def _tile(p, q, acc, ROWS: tl.constexpr, ROW: tl.constexpr):
    """acc + q @ tile^T for the [ROWS, ROW] byte tile at `p` read as fp16 pairs (the
    values don't matter): a dot consumes the codes, as in decode, so Triton's pipeliner
    stages them through shared memory (cp.async)."""
    H: tl.constexpr = ROW // 2
    o = tl.arange(0, ROWS)[:, None] * H + tl.arange(0, H)[None, :]
    p16 = p.to(tl.pointer_type(tl.float16), bitcast=True)
    return tl.dot(q, tl.trans(tl.load(p16 + o)), acc)


@triton.jit
def _meta(p, s, N: tl.constexpr):
    """s scaled by the N fp16 values at `p`, split per score column the way decode's
    folded scales are (`decode_warp._meta`: a flat run reshaped to [columns, N/columns])."""
    m = tl.load(p + tl.arange(0, N)).to(tl.float32)
    if N // s.shape[1] == 2:
        a, b = tl.split(tl.reshape(m, (s.shape[1], 2)))
        s = s * a[None, :] + b[None, :]
    else:
        a, b = tl.split(tl.reshape(m, (s.shape[1], 2, 2)))
        s = s * tl.sum(a, 1)[None, :] + tl.sum(b, 1)[None, :]
    return s


@triton.jit
def _read_kernel(K, V, KM0, KM1, VM0, VM1, Out, tiles_per_split, head_bytes, meta_halves,
                 BLOCK_N: tl.constexpr, ROW: tl.constexpr, META: tl.constexpr,
                 LAYOUT: tl.constexpr, STRIDED: tl.constexpr):
    """One program reads its split of one head: per tile [BLOCK_N, ROW] bytes of K and of
    V codes, plus the tile's metadata (META fp16 values per array and tile) in the given
    layout (0 codes, 1 split, 2 pair, 3 paged). The bytes feed fp16 dots with a zero
    query and the metadata scales the [16, BLOCK_N] results, so the compiler
    keeps every load and pipelines them like decode_warp.py's."""
    head = tl.program_id(0)
    split = tl.program_id(1)
    q = tl.full([16, ROW // 2], 0.0, dtype=tl.float16)
    total = tl.zeros([16, 16], dtype=tl.float32)
    ones = tl.full([BLOCK_N, 16], 1.0, dtype=tl.float16)
    # paged: a tile is BLOCK_N rows of codes followed by its metadata (2 * META halves)
    TILE: tl.constexpr = BLOCK_N * ROW + (4 * META if LAYOUT == 3 else 0)
    if STRIDED:  # split s reads tiles s, s + S, s + 2S, ...: all programs sweep together
        t_lo = split
        t_hi = tiles_per_split * tl.num_programs(1)
        t_step = tl.num_programs(1)
    else:  # split s reads one contiguous run of tiles (decode_warp.py's split_range)
        t_lo = split * tiles_per_split
        t_hi = t_lo + tiles_per_split
        t_step = 1
    for t in range(t_lo, t_hi, t_step):
        base = head.to(tl.int64) * head_bytes + t * TILE  # < 2^31 per head
        zero = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        sk = _tile(K + base, q, zero, BLOCK_N, ROW)
        sv = _tile(V + base, q, zero, BLOCK_N, ROW)
        mbase = head.to(tl.int64) * meta_halves + t * META
        if LAYOUT == 1:
            sk = _meta(KM1 + mbase, _meta(KM0 + mbase, sk, META), META)
            sv = _meta(VM1 + mbase, _meta(VM0 + mbase, sv, META), META)
        elif LAYOUT == 2:
            sk = _meta(KM0 + 2 * mbase, sk, 2 * META)
            sv = _meta(VM0 + 2 * mbase, sv, 2 * META)
        elif LAYOUT == 3:
            pk = (K + base + BLOCK_N * ROW).to(tl.pointer_type(tl.float16), bitcast=True)
            pv = (V + base + BLOCK_N * ROW).to(tl.pointer_type(tl.float16), bitcast=True)
            sk = _meta(pk, sk, 2 * META)
            sv = _meta(pv, sv, 2 * META)
        # into a dot, like decode's P: Triton then stages the metadata loads too
        total = tl.dot((sk + sv).to(tl.float16), ones, total)
    tl.store(Out + head * tl.num_programs(1) + split, tl.sum(tl.sum(total, 1), 0))


def make_case(context: int, row_bytes: int, layout: str, heads: int = 8, block_n: int = 32,
              meta_bytes_per_row: int = 4, per_sm: int = 8, device: str = "cuda",
              strided: bool = False):
    """(run, bytes read): buffers for one layer's K and V of `heads` heads and a launch
    that reads them the way decode_warp.py does. `meta_bytes_per_row`: per K (or V) row,
    the bytes of each metadata array (int8 / int4 g64 at D = 128: 2 groups x 2 B scales,
    the same of biases)."""
    tiles = context // block_n
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    splits = max(1, per_sm * sms // heads)
    splits = next(s for s in range(splits, 0, -1) if tiles % s == 0)
    meta = 0 if layout == "codes" else block_n * meta_bytes_per_row // 2  # halves/array/tile
    paged = layout == "paged"
    head_bytes = tiles * (block_n * row_bytes + (4 * meta if paged else 0))
    k = torch.randint(-3, 4, (heads * head_bytes,), dtype=torch.int8, device=device)
    v = torch.randint_like(k, -3, 4)
    n_meta = heads * tiles * max(meta, 16) * (2 if layout == "pair" else 1)
    km0, km1, vm0, vm1 = (torch.rand(n_meta, dtype=torch.float16, device=device)
                          for _ in range(4))
    out = torch.empty(heads * splits, dtype=torch.float32, device=device)
    code = LAYOUTS.index(layout)
    nbytes = 2 * heads * tiles * block_n * row_bytes + (
        0 if layout == "codes" else 4 * heads * tiles * block_n * meta_bytes_per_row)

    def run():
        _read_kernel[(heads, splits)](
            k, v, km0, km1, vm0, vm1, out, tiles // splits, head_bytes, tiles * max(meta, 16),
            BLOCK_N=block_n, ROW=row_bytes, META=max(meta, 16), LAYOUT=code,
            STRIDED=strided, num_warps=1, num_stages=3)

    return run, nbytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--rows", type=int, nargs="+", default=[128, 64, 256],
                   help="code bytes per K/V row (int8 at D=128: 128, int4: 64, fp16: 256)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--per-sm", type=int, nargs="+", default=[8])
    p.add_argument("--order", nargs="+", default=["contiguous"], choices=["contiguous", "strided"],
                   help="tiles of a split: one contiguous run (as decode today) or every "
                        "S-th tile (all programs sweep the cache together)")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--out", default=None, help="append JSON rows to this file")
    args = p.parse_args()
    if args.context <= 0 or args.context % 32:
        p.error(f"--context must be a positive multiple of 32 (one tile), got {args.context}")
    if any(r < 32 or r & (r - 1) for r in args.rows):
        p.error(f"--rows must be powers of two >= 32 bytes, got {args.rows}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (it times a GPU kernel)")
    from kvtax.harness.bench.gpu_timer import Timer
    from kvtax.harness.bench.read_ceiling import read_ceiling

    timer = Timer(args.reps, dry=False, flush="read")
    ceiling, _ = read_ceiling(timer)
    print(f"read ceiling {ceiling:.2f} TB/s ({torch.cuda.get_device_name()})", flush=True)
    for row in args.rows:
        for layout in args.layouts:
            for per_sm, order in itertools.product(args.per_sm, args.order):
                if row > 128 and layout != "codes":
                    continue  # fp16 rows carry no metadata
                run, nbytes = make_case(args.context, row, layout, per_sm=per_sm,
                                        strided=order == "strided")
                ms, p20, p80 = timer(run)
                tbps = nbytes / (ms * 1e-3) / 1e12
                rec = dict(context=args.context, row_bytes=row, layout=layout, per_sm=per_sm,
                           order=order,
                           ms=ms, p20=p20, p80=p80, bytes=nbytes, tbps=tbps,
                           of_ceiling=tbps / ceiling)
                print(f"row {row:3d} B  {layout:6s} {per_sm:2d}/SM {order:10s}  {ms:.4f} ms  "
                      f"{tbps:.2f} TB/s  {100 * tbps / ceiling:.0f}% of ceiling", flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                        f.flush()
                        os.fsync(f.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
