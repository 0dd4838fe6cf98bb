"""The launch table: which kernel and which tiles serve a call, as rules with reasons.

`launch_config(q, view)` is deterministic (shapes, dtypes and formats in, a
`LaunchConfig` out). Every rule below was measured on an H200 at 128k tokens,
Llama-3.1-8B layer shapes; docs/KERNELS.md keeps the numbers and what lost.

Decode (L <= 16 query rows, G * L <= 128; `decode_rows`). A hybrid cache's parts each take
their row below and share one workspace and one reduce (`launch.launch_parts_decode`):
  G * L <= 16 on a cache decode_warp.py serves:
    fp8 K and V                 → warp, 16-slot tiles (15% faster than 32)
    float K and V               → warp, 4 programs per SM (5-15% faster than 8)
    int8 / int4 the Gluon kernel serves (G * L <= 4, group 64, D 128, no soft-cap or
    left padding; also int4-c64 or int4w-c64 keys beside int4 g64 values, q4's body,
    with the hybrid cache's min_distance / min_key masks: whole q4 decode 0.065 ms at
    128k, was 0.137)
                                → swap (slots as the MMA's M, no padded query rows:
                                  10-20% faster than warp)
    int8 K and V                → warp, two pipeline stages (8% faster than three)
    otherwise (int4-c64 / int4w-c64 keys with other values too)
                                → warp, defaults
  otherwise (3-bit K or V: `support.three_bit_reason`)
                                → tile (decode.py: up to 128 packed rows, 4-8 warps)
Prefill (longer chunks): tiles by query dtype and head dim (`_prefill_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from kvtax.attention.support import (
    gluon_swap_reason, half_width, is_int4, three_bit_reason, warp_reason,
)
from kvtax.attention.view import CacheView
from kvtax.formats import AffineFormat, ChannelBlockFormat, FP8Format
from kvtax.formats.widest import WidestBitFormat

MAX_DECODE_ROWS = 16  # query rows served by the decode kernels
MAX_DECODE_TILE = 128  # G * L rows packed into one decode program


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch settings of one call (see `launch_config`).

    kernel: decode only: "warp" (decode_warp.py, one warp per split), "swap" (the Gluon
    kernel, or decode_swap.py where it cannot run) or "tile" (decode.py).
    fold: apply K/V scales to scores / P instead of every element (the tile kernel).
    pdl_launch / pdl_late: under programmatic dependent launch (kvtax.pdl), launch while
    the kernel before runs; let the reduce launch at this kernel's end, not first thing
    (see `swap_decode_config`). pdl_beside: run beside the kernel before it (a hybrid
    cache's later part, "swap" kernels: `launch.launch_parts_decode`).
    """

    path: str  # "decode" or "prefill"
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    fold: bool = False
    kernel: str = "tile"
    pdl_launch: bool = False
    pdl_late: bool = True
    pdl_beside: bool = False
    max_registers: int | None = None  # ptxas's cap (`maxnreg`), where the table sets one
    per_sm: int | None = None  # programs per SM the grid was sized for (one-warp kernels)


@lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; 4 under the interpreter (a few splits, so
    tests cover the reduction)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def max_slots(view: CacheView, lengths: torch.Tensor | None) -> int:
    """Upper bound on the slots a call may scan; from capacity when lengths are on device
    (a captured graph's launch must not depend on the host length)."""
    capacity = view.k.codes.shape[2]
    if lengths is None:
        return view.num_slots
    return min(capacity, view.sinks + view.ring) if view.ring else capacity


def launch_config(
    q: torch.Tensor, view: CacheView, lengths: torch.Tensor | None = None, *,
    softcap: bool = False, masked: bool = False,
) -> LaunchConfig:
    """The launch of `triton_attention(q, view)` (q `[B, H_q, L, D]`): the rules in this
    module's docstring. The Gluon decode kernel takes neither soft-capping nor `masked`
    calls (left padding); the hybrid cache's min_distance / min_key it applies itself."""
    n_q, group = q.shape[2], q.shape[1] // view.num_kv_heads
    if not decode_rows(q, view):
        return _prefill_config(q, view)
    if group * n_q > 16 or warp_reason(view) is not None:
        return tile_decode_config(q, view, lengths)
    fmts = (view.spec.key, view.spec.value)
    if all(isinstance(f, FP8Format) for f in fmts):
        return warp_decode_config(q, view, lengths, block_n=16)
    if not any(f.is_quantized for f in fmts):
        return warp_decode_config(q, view, lengths, per_sm=4)
    if not (softcap or masked) and gluon_swap_reason(q, view) is None:
        return swap_decode_config(q, view, lengths)
    if all(isinstance(f, AffineFormat) and f.bits == 8 for f in fmts):
        return warp_decode_config(q, view, lengths, num_stages=2)
    return warp_decode_config(q, view, lengths)


def decode_rows(q: torch.Tensor, view: CacheView) -> bool:
    """True when q `[B, H_q, L, D]`'s rows take a decode kernel (L <= 16, G * L <= 128)."""
    n_q, group = q.shape[2], q.shape[1] // view.num_kv_heads
    return n_q <= MAX_DECODE_ROWS and group * n_q <= MAX_DECODE_TILE


def _prefill_config(q: torch.Tensor, view: CacheView) -> LaunchConfig:
    """prefill.py's tiles: float32 queries small tiles; D = 80, 96 (per-dim scale
    gathers need registers) 8 warps; D <= 128 wide 128 x 128 tiles, 64 x 128 over 4 warps
    for int4-c64 keys; D 256 64 x 64; 3-bit K or V `_three_bit_prefill_config`; int4w-c64
    keys 64 x 64 over 4 warps, chosen by compile-only builds for sm_90 (Triton 3.9,
    `benchmarks/compile_check.py`): no spill at D 64 / 128, where int4-c64's 64 x 128
    over 3 stages spilled 80 / 72 bytes with the fifth bits; speed not yet measured on
    a GPU.

    int4-c64 keys (a scale and bias per channel and 64-slot block, so each thread holds
    its columns' vectors for the tile's two blocks and the next tile's) measured 35%
    faster on 64 rows over 4 warps (H200, 64k, fp16: 273 vs 203 TFLOP/s); plain int4 gains
    nothing there (293 vs 295). docs/KERNELS.md."""
    half = half_width(view.head_dim)
    if q.dtype == torch.float32:
        return LaunchConfig("prefill", 64, 32, 4, 2)
    if half != view.head_dim // 2:
        return LaunchConfig("prefill", 64, 64, 8, 2)
    if three_bit_reason(view) is not None:
        return _three_bit_prefill_config(half)
    if isinstance(view.spec.key, WidestBitFormat):  # int4-c64's tiles spill (docstring)
        return LaunchConfig("prefill", 64, 64, 4, 2)
    if half <= 64 and isinstance(view.spec.key, ChannelBlockFormat):
        return LaunchConfig("prefill", 64, 128, 4, 3)
    if half <= 64:
        return LaunchConfig("prefill", 128, 128, 8, 3)
    return LaunchConfig("prefill", 64, 64, 4, 2)


def _three_bit_prefill_config(half: int) -> LaunchConfig:
    """prefill.py's tiles where K or V holds 3-bit codes: 128 x 64 over 8 warps at D <= 128,
    64 x 32 over 4 warps at D 256. Chosen by compile-only builds for sm_90, not timings
    (Triton 3.9, `benchmarks/compile_check.py --only int3 --full`): none spills at D 64 /
    128, 64 bytes of stack at D 256, where `_prefill_config`'s other tiles spilled q3's body
    312 / 216 / 360 bytes; speed not yet measured on a GPU."""
    if half <= 64:
        return LaunchConfig("prefill", 128, 64, 8, 3)
    return LaunchConfig("prefill", 64, 32, 4, 2)


def _splits(view: CacheView, q: torch.Tensor, lengths: torch.Tensor | None, block_n: int,
            per_sm: int, min_tiles: int, cap: int, programs: int) -> int:
    """Splits per (batch, KV head): `per_sm` programs per SM over `programs` (batch x
    heads) rounded down (a few past it would run as a second, nearly empty wave), each
    split at least `min_tiles` tiles of `block_n` slots, at most `cap`."""
    tiles = triton.cdiv(max(max_slots(view, lengths), 1), block_n)
    want = max(1, per_sm * sm_count(q.device) // programs)
    return max(1, min(want, triton.cdiv(tiles, min_tiles), cap))


def warp_decode_config(
    q: torch.Tensor, view: CacheView, lengths: torch.Tensor | None = None, *,
    block_n: int = 32, per_sm: int = 8, num_stages: int = 3,
) -> LaunchConfig:
    """decode_warp.py's launch: one warp per program, `per_sm` programs per SM (8: one
    wave of the 8 warps an SM holds at ~255 registers), splits of >= 4 tiles, a normal
    launch letting the reduce go at its end under PDL (measured best, docs/KERNELS.md)."""
    splits = _splits(view, q, lengths, block_n, per_sm, 4, 1024,
                     q.shape[0] * view.num_kv_heads)
    return LaunchConfig("decode", 16, block_n, 1, num_stages, splits, kernel="warp",
                        per_sm=per_sm)


def swap_decode_config(
    q: torch.Tensor, view: CacheView, lengths: torch.Tensor | None = None, *,
    per_sm: int | None = None, num_stages: int = 2,
) -> LaunchConfig:
    """decode_swap's launch: one warp per program, 32-slot steps, two stages, `per_sm`
    programs per SM (default 12 for int4 K and V, the most the Gluon kernel's registers
    allow, else 8; int4-c64 keys beside int4 values: 12 in fp16 (168 registers on sm_90,
    Triton 3.6 and 3.9), 8 in bf16 (206-236: the block vectors' conversions to fp16);
    int4w-c64 keys 8 (199-229: the queries' gather through the channel order,
    docs/KERNELS.md)), splits of >= 4 steps. At 12 per SM the Gluon kernel is capped at
    168 registers: three one-warp programs per scheduler fit only at <= 168 (65,536 / 4 /
    3 / 32, in ptxas's steps of 8); int4w-c64 keys compile without spills under it
    (`per_sm=12`, attention.py's "swap-sm12" variant).

    Under programmatic dependent launch (kvtax.pdl) the kernel launches early only where
    its grid fills every SM at 12 per SM (a smaller grid launched early lands unevenly
    and the next kernels' early programs cost it time), and lets the reduce go first
    thing only then, else at its end (docs/KERNELS.md)."""
    if per_sm is None:
        key, value = view.spec.key, view.spec.value
        if isinstance(key, WidestBitFormat):  # 199-229 registers on sm_90 (docstring)
            per_sm = 8
        elif isinstance(key, ChannelBlockFormat):
            per_sm = 12 if is_int4(value) and q.dtype == torch.float16 else 8
        else:
            per_sm = 12 if is_int4(key) and is_int4(value) else 8
    programs = q.shape[0] * view.num_kv_heads
    splits = _splits(view, q, lengths, 32, per_sm, 4, 1024, programs)
    full_grid = splits == max(1, per_sm * sm_count(q.device) // programs)
    return LaunchConfig("decode", 16, 32, 1, num_stages, splits, kernel="swap",
                        pdl_launch=per_sm >= 12 and full_grid, pdl_late=per_sm < 12,
                        max_registers=168 if per_sm >= 12 else None, per_sm=per_sm)


def tile_decode_config(
    q: torch.Tensor, view: CacheView, lengths: torch.Tensor | None = None
) -> LaunchConfig:
    """decode.py's launch (any shape up to 128 packed rows; 4-8 warps per program):
    128-slot tiles for float caches, 64 for quantized ones (int4 at 128 failed the fp16
    error bound), 32 past D 128; ~8 programs per SM keep one long sequence streaming."""
    n_q, group = q.shape[2], q.shape[1] // view.num_kv_heads
    half = half_width(view.head_dim)
    block_m = max(16, triton.next_power_of_2(group * n_q))
    wide = not any(f.is_quantized for f in (view.spec.key, view.spec.value))
    block_n = 32 if half > 64 else (128 if wide else 64)
    stages = 3
    if q.dtype == torch.float32 and half != view.head_dim // 2:
        # float32 queries at D = 80 / 96 gather per-dim scales: 64-slot tiles over 3 stages
        # asked 308-332 KiB of shared memory (sm_90 has 227), 32 over 2 asks 92-98
        block_n, stages = 32, 2
    warps = 4 if block_m * half < 64 * 64 else 8
    bh = q.shape[0] * view.num_kv_heads
    tiles = triton.cdiv(max(max_slots(view, lengths), 1), block_n)
    want = triton.cdiv(8 * sm_count(q.device), bh)  # rounded up, unlike the one-warp kernels
    splits = max(1, min(want, triton.cdiv(tiles, 2), 256))
    return LaunchConfig("decode", block_m, block_n, warps, stages, splits, fold=True)
