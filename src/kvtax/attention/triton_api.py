"""Checked entry points to the fused Triton attention kernels over quantized KV.

    >>> from kvtax.attention.triton_api import triton_attention, unsupported_reason
    >>> unsupported_reason(q, cache.view())          # None: the kernels can serve it
    >>> out = triton_attention(q, cache.view())      # q [B, H_q, L, D] → [B, H_q, L, D]
    >>> out, lse = triton_attention_lse(q, view, min_distance=128)  # a hybrid cache's part

L <= 16 query rows take the split-KV decode kernel plus a reduction; longer chunks take
the prefill kernel. Both read the cache's quantized storage directly and dequantize
tiles in registers. On CPU the kernels run through Triton's interpreter when
`TRITON_INTERPRET=1` was set when this module was imported (how CI tests them);
`unsupported_reason` still reports CPU tensors as unsupported, so dispatch and callers
that choose a path keep using the reference there.

CUDA graphs: pass `lengths` (int32 `[B]` on q's device) and keep the storage fixed
(a preallocated FullCache, or a SlidingCache with `max_chunk`); launch shapes then
depend only on the cache's capacity, and the kernels read the lengths at run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from kvtax import pdl
from kvtax.attention.kernels.decode import _decode_attn_split_kernel
from kvtax.attention.kernels.decode_packed import _decode_packed_kernel
from kvtax.attention.kernels.decode_swap import _decode_swap_kernel
from kvtax.attention.kernels.decode_warp import _decode_warp_kernel
from kvtax.attention.kernels.prefill import _prefill_attn_fwd_kernel
from kvtax.attention.kernels.reduce import _decode_attn_reduce_kernel
from kvtax.attention.reference import check_kv_start, check_query, rotate_query, unrotate_output
from kvtax.attention.view import CacheView
from kvtax.errors import ShapeError
from kvtax.formats import AffineFormat, FloatFormat, FP8Format, KVFormat, KVSpec, QTensor

SUPPORTS_KV_START = True  # dispatch passes left-padding starts (kv_start) to the kernels
MAX_DECODE_ROWS = 16  # query rows served by the decode kernel
MAX_DECODE_TILE = 128  # G * L rows packed into one decode program
_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Test hook: fill split-KV partials (and triton_attention_lse's outputs) with NaN before
# each launch so unwritten ones show.
POISON_WORKSPACE = False


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch settings of one call (see `launch_config`)."""

    path: str  # "decode" or "prefill"
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    fold: bool = False  # apply K/V scales to scores / P instead of every element (decode)
    f16_math: bool = True  # fp16 models dequantize in fp16
    kernel: str = "tile"  # decode: "warp" (decode_warp.py, one warp per split), "swap"
    # (decode_swap.py: slots as the MMA's M), "packed" (decode_packed.py:
    # heads_per_program KV heads' rows in one tile) or "tile"
    heads_per_program: int = 1
    maxnreg: int | None = None  # register cap per thread (more resident warps), or None
    v_pairs: bool = True  # warp decode: int8/int4 V read as uint16 pairs where possible
    lazy: bool = True  # warp decode: rescale only when the max grows by > 2^8 (a branch)
    strided: bool = True  # warp decode: split s takes every S-th tile (False: one run)
    # decode under programmatic dependent launch (kvtax.pdl): launch early (while the
    # kernel before runs); let the reduce launch at this kernel's end, not first thing.
    # The default is the placement measured best for grids below the SMs' occupancy
    # limit (swap_decode_config); int4's full grid opts into the early one.
    pdl_launch: bool = False
    pdl_late: bool = True


def _pdl(kind: str, q: torch.Tensor, cfg: LaunchConfig | None = None) -> dict:
    """Launch keywords for programmatic dependent launch (kvtax.pdl): the decode kernels'
    and the reduce's PDL / PDL_LATE constexprs and launch_pdl; {} when off. A decode
    kernel's config narrows them (`pdl_launch`, `pdl_late`; see swap_decode_config)."""
    opts = pdl.launch_options(kind, q, _interpreting())
    if opts and cfg is not None:
        opts["launch_pdl"] = opts["launch_pdl"] and cfg.pdl_launch
        opts["PDL_LATE"] = opts["PDL_LATE"] or cfg.pdl_late
    return opts


def _interpreting() -> bool:
    """True when these kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at
    import): then triton_attention also runs on CPU tensors (how CI tests the kernels)."""
    return type(_decode_attn_split_kernel).__name__ == "InterpretedFunction"


def _format_code(fmt: KVFormat) -> tuple[int, int] | None:
    """(kernel format code, group size) or None when the kernels don't know the format."""
    if isinstance(fmt, FloatFormat):
        return 0, 0
    if isinstance(fmt, AffineFormat):
        return (1 if fmt.n_bits == 8 else 2), fmt.group_size
    if isinstance(fmt, FP8Format):
        return 3, 0
    return None


def unsupported_reason(q: torch.Tensor, view: CacheView) -> str | None:
    """None when the kernels can serve `triton_attention(q, view)` on CUDA, else why not."""
    return _unsupported(q, view, allow_cpu=False)


def _unsupported(q: torch.Tensor, view: CacheView, allow_cpu: bool) -> str | None:
    if not (q.is_cuda or allow_cpu):
        return "tensors are not on a CUDA device"
    if q.dtype not in _Q_DTYPES:
        return f"query dtype {q.dtype} (the kernels take float16, bfloat16, float32)"
    d = view.head_dim
    if d % 2 or not 16 <= d <= 256:
        return f"head_dim {d} (the kernels take even head dims from 16 to 256)"
    for part, fmt in (("key", view.spec.key), ("value", view.spec.value)):
        if _format_code(fmt) is None:
            return f"{part} format {fmt.name} has no kernel"
    for qt in (view.k, view.v):
        if any(t.stride(-1) != 1 for t in qt.parts()):
            return "cache storage rows are not contiguous (last stride != 1)"
        if qt.scales is not None and qt.biases is not None and qt.scales.stride() != qt.biases.stride():
            return "cache scales and biases have different strides"
    if q.dim() == 4 and q.shape[0] * view.num_kv_heads >= 2**31:
        return "batch * kv_heads too large for the launch grid"
    return None


def _half(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim // 2))


@lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so tests cover the reduction


def _max_slots(view: CacheView, lengths: torch.Tensor | None) -> int:
    """Upper bound on the slots a call may scan; from capacity when lengths are on device."""
    capacity = view.k.codes.shape[2]
    if lengths is None:
        return view.num_slots
    return min(capacity, view.sinks + view.ring) if view.ring else capacity


def launch_config(
    q: torch.Tensor, view: CacheView, lengths: torch.Tensor | None = None, *,
    softcap: bool = False, masked: bool = False,
) -> LaunchConfig:
    """The deterministic heuristic table: tiles by head_dim, dtype and query rows. The
    Gluon decode kernel takes neither soft-capping nor `masked` calls (left padding, the
    hybrid cache's min_distance / min_key)."""
    n_q, group = q.shape[2], q.shape[1] // view.num_kv_heads
    half = _half(view.head_dim)
    if n_q <= MAX_DECODE_ROWS and group * n_q <= MAX_DECODE_TILE:
        if group * n_q <= 16 and _warp_reason(view) is None:
            # H200 sweep at 128k (docs/KERNELS.md, run 7): fp8 prefers 16-slot tiles
            # (0.093 vs 0.110 ms), float caches 4 programs per SM (0.143 vs 0.151-0.167)
            fmts = (view.spec.key, view.spec.value)
            if all(isinstance(f, FP8Format) for f in fmts):
                return warp_decode_config(q, view, lengths, block_n=16)
            if not any(f.is_quantized for f in fmts):
                return warp_decode_config(q, view, lengths, per_sm=4)
            # int8 / int4 (group 64, D 128) with G * L <= 4: the Gluon swapped kernel,
            # 0.083 / 0.056 ms vs decode_warp's 0.091 / 0.070 at 128k (H200)
            if not (softcap or masked) and gluon_swap_reason(q, view) is None:
                return swap_decode_config(q, view, lengths)
            # int8 K and V: two pipeline stages, 0.084-0.085 vs 0.092 ms at 128k in two
            # runs of one process; fp8 (0.103) and int4 (0.077 vs 0.069) lost with two
            # (H200, docs/BENCHMARKS.md)
            if all(isinstance(f, AffineFormat) and f.bits == 8 for f in fmts):
                return warp_decode_config(q, view, lengths, num_stages=2)
            return warp_decode_config(q, view, lengths)
        return tile_decode_config(q, view, lengths)
    if q.dtype == torch.float32:
        return LaunchConfig("prefill", 64, 32, 4, 2)
    if half != view.head_dim // 2:  # D = 80, 96: per-dim scale gathers need registers
        return LaunchConfig("prefill", 64, 64, 8, 2)
    if half <= 64:
        return LaunchConfig("prefill", 128, 128, 8, 3)
    return LaunchConfig("prefill", 64, 64, 4, 2)


def warp_decode_config(
    q: torch.Tensor, view: CacheView, lengths: torch.Tensor | None = None, *,
    block_n: int = 32, per_sm: int = 8, num_stages: int = 3, num_warps: int = 1,
    maxnreg: int | None = None, v_pairs: bool = True, lazy: bool = True,
    strided: bool = True, pdl_launch: bool = False, pdl_late: bool = True,
) -> LaunchConfig:
    """decode_warp.py's launch: one warp per program, `per_sm` programs per SM (8: one
    wave of the 8 warps an SM holds at ~255 registers, measured best on the H200 at
    128k, docs/KERNELS.md); splits of >= 4 tiles. `pdl_launch` / `pdl_late`: see
    swap_decode_config (bf16 at 32k in the model, H200: a normal launch
    letting go at the end 5.163 ms per token, launched early 5.403, letting go first
    thing 5.430, PDL on the GEMVs only 5.199)."""
    bh = q.shape[0] * view.num_kv_heads
    tiles = triton.cdiv(max(_max_slots(view, lengths), 1), block_n)
    # rounded down: a few programs past per_sm x SMs would run as a second, nearly empty wave
    want = max(1, per_sm * _sm_count(q.device) // bh)
    splits = max(1, min(want, triton.cdiv(tiles, 4), 1024))
    return LaunchConfig("decode", 16, block_n, num_warps, num_stages, splits, kernel="warp",
                        maxnreg=maxnreg, v_pairs=v_pairs, lazy=lazy, strided=strided,
                        pdl_launch=pdl_launch, pdl_late=pdl_late)


def swap_decode_config(
    q: torch.Tensor, view: CacheView, lengths: torch.Tensor | None = None, *,
    per_sm: int | None = None, num_stages: int = 2, lazy: bool = True,
    maxnreg: int | None = None, pdl_launch: bool | None = None, pdl_late: bool | None = None,
) -> LaunchConfig:
    """decode_swap's launch: one warp per program, 32-slot steps, two stages,
    `per_sm` programs per SM: 12 for int4 K and V, else 8 (the Gluon kernel's best on the
    H200 at 128k: int4 0.056 ms at 12 vs 0.063 at 8; int8 0.083 at 8 vs 0.084 at 12,
    docs/KERNELS.md); splits of >= 4 steps. `lazy` (default): rescale only when
    a score or V scale outgrows the running reference (one warp-wide max per step instead
    of the column max, the V-scale max and the accumulator rescale; H200 at 128k:
    int8 0.082 vs 0.083 ms, int4 0.055 vs 0.057). `maxnreg`: the Gluon kernel's
    register cap (a sweep knob; 64-slot steps measured no faster, docs/KERNELS.md).

    Under programmatic dependent launch (kvtax.pdl), `pdl_launch`: this kernel may start
    while the one before it runs; `pdl_late`: it lets the reduce (and through it the next
    GEMV) launch at its end rather than first thing. Default (None): both early at 12
    per SM, the most the Gluon kernel's registers allow, else a normal launch letting go
    at the end. The likely reason (docs/BENCHMARKS.md): below that limit,
    programs launched early land unevenly, and the next kernels' programs, launched
    early, wait resident beside this kernel's and cost it time (H200, Llama-3.1-
    8B: int8 at 8 per SM, 32k: 4.923 ms per token launched early letting go
    first thing, 4.657 letting go at the end, 4.682 with PDL on the GEMVs only; 128k:
    6.510 launched early, 6.406 without PDL; int4 at 12 per SM, 32k: 4.437 first thing,
    4.469 at the end). Pulling each program's first tiles into L2 before its PDL wait
    measured no faster (int4 at 32k, 2 tiles: 4.489 vs 4.483 ms; 8: 4.643; int8 +1.2%;
    experiment reverted)."""
    if per_sm is None:
        int4 = all(_is_int4(f) for f in (view.spec.key, view.spec.value))
        per_sm = 12 if int4 else 8
    bh = q.shape[0] * view.num_kv_heads
    steps = triton.cdiv(max(_max_slots(view, lengths), 1), 32)
    want = max(1, per_sm * _sm_count(q.device) // bh)
    splits = max(1, min(want, triton.cdiv(steps, 4), 1024))
    if pdl_launch is None:
        # early only where the grid fills every SM: a smaller grid launched early lands
        # on the SMs that had room first (int4 at 4k, 256 programs: 10.8 µs of the
        # step's critical path per layer vs 7.0 without PDL; the
        # whole step 4.279 ms launched early vs 4.175 normally, call 3)
        pdl_launch = per_sm >= 12 and splits == want
    if pdl_late is None:
        pdl_late = per_sm < 12
    return LaunchConfig("decode", 16, 32, 1, num_stages, splits, kernel="swap", lazy=lazy,
                        maxnreg=maxnreg, pdl_launch=pdl_launch, pdl_late=pdl_late)


def swap_reason(q: torch.Tensor, view: CacheView) -> str | None:
    """None when decode_swap.py serves this call: G * L <= 4 fp16 / bf16 query rows, a
    full cache (no ring, window or sinks), head_dim 64 / 128 / 256, int8 or int4 K and V
    with one scale group per row or per half row, packed scale rows (pairs of 16-bit
    values 4-byte aligned when two groups), V code rows 2-byte aligned."""
    n_q, h_q, d = q.shape[2], q.shape[1], view.head_dim
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"queries are {q.dtype}"
    if h_q // view.num_kv_heads * n_q > 4:
        return f"G * L = {h_q // view.num_kv_heads * n_q} > 4"
    if view.ring or view.window is not None or view.sinks:
        return "ring / window / sinks"
    if d not in (64, 128, 256):
        return f"head_dim {d} not in (64, 128, 256)"
    for part, fmt, qt in (("key", view.spec.key, view.k), ("value", view.spec.value, view.v)):
        if not isinstance(fmt, AffineFormat) or fmt.n_bits not in (4, 8):
            return f"{part} format {fmt} is not int8 / int4"
        if fmt.group_size < d // 2:
            return f"{part} group size {fmt.group_size} < head_dim / 2"
        ng = d // fmt.group_size
        sc, bi = qt.scales, qt.biases
        if sc.stride() != bi.stride() or sc.stride(-2) != ng:
            return f"{part} scale rows are not packed"
        if ng == 2 and (any(t.data_ptr() % 4 for t in (sc, bi))
                        or any(st % 2 for st in sc.stride()[:2])):
            return f"{part} scale pairs are not 4-byte aligned"
    if not _v_pairs(view):
        return "value code rows are not 2-byte aligned"
    return None


def _gluon_swap_kernel():
    """decode_swap_gluon's kernel, or the reason it cannot be loaded (Gluon is Triton's
    experimental dialect: an API change must cost speed, not the import of kvtax)."""
    global _GLUON_SWAP
    if _GLUON_SWAP is None:
        try:
            from kvtax.attention.kernels.decode_swap_gluon import _decode_swap_gluon_kernel
            _GLUON_SWAP = _decode_swap_gluon_kernel
        except Exception as exc:  # noqa: BLE001 (any import-time failure: use the twin)
            _GLUON_SWAP = f"Gluon unavailable ({type(exc).__name__}: {exc})"
    return _GLUON_SWAP


_GLUON_SWAP: object = None


def gluon_swap_reason(q: torch.Tensor, view: CacheView) -> str | None:
    """None when decode_swap_gluon.py serves this call (the CUDA path of kernel "swap"):
    `swap_reason`'s cases with int8 or int4 in groups of 64 for both K and V at head_dim
    128, packed code rows, scales in the queries' dtype, compiled (not interpreted)
    Triton with Gluon. Otherwise kernel "swap" runs decode_swap.py, its Triton twin."""
    if _interpreting():
        return "Gluon kernels do not run in Triton's interpreter"
    if torch.version.hip is not None:
        return "the Gluon kernel is written for NVIDIA GPUs"
    if q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 0):
        return "the Gluon kernel needs sm_80+ (cp.async, mma.sync m16n8k16)"
    reason = swap_reason(q, view)
    if reason is not None:
        return reason
    k, v = view.spec.key, view.spec.value
    if view.head_dim != 128 or k.n_bits != v.n_bits or k.group_size != 64 or v.group_size != 64:
        return "Gluon swap serves int8 / int4 K and V alike, group 64, head_dim 128"
    row = 128 if k.n_bits == 8 else 64
    for qt in (view.k, view.v):
        if qt.codes.shape[-1] != row or qt.codes.stride(-1) != 1:
            return "code rows are not packed"
        if qt.scales.dtype != q.dtype or qt.biases.dtype != q.dtype:
            return "scales are not in the queries' dtype"
    kernel = _gluon_swap_kernel()
    return kernel if isinstance(kernel, str) else None


def packed_decode_config(
    q: torch.Tensor, view: CacheView, lengths: torch.Tensor | None = None, *,
    heads_per_program: int, block_n: int = 16, per_sm: int = 8, num_stages: int = 2,
) -> LaunchConfig:
    """decode_packed.py's launch: one warp per program serving `heads_per_program` KV
    heads (see `heads_per_program`), `per_sm` programs per SM, splits of >= 4 tiles.

    Opt-in (`config=`; benchmarks/attention.py's `p-*` sweep variants): on the H200 it
    measured 2x slower than decode_warp.py at 128k (docs/KERNELS.md)."""
    groups = q.shape[0] * view.num_kv_heads // heads_per_program
    tiles = triton.cdiv(max(_max_slots(view, lengths), 1), block_n)
    want = max(1, per_sm * _sm_count(q.device) // groups)
    splits = max(1, min(want, triton.cdiv(tiles, 4), 1024))
    return LaunchConfig("decode", 16, block_n, 1, num_stages, splits, kernel="packed",
                        heads_per_program=heads_per_program)


def heads_per_program(q: torch.Tensor, view: CacheView) -> int:
    """KV heads whose G * L query rows decode_packed.py packs into one 16-row tile: the
    largest power of two <= 16 / (G * L) dividing H_kv, or 1 where it doesn't serve
    (float or fp8 formats, float32 queries, head dims it can't take)."""
    rows = q.shape[2] * (q.shape[1] // view.num_kv_heads)
    if _packed_reason(q, view) is not None or rows > 8:
        return 1
    hp = 1
    while hp * 2 * rows <= 16 and view.num_kv_heads % (hp * 2) == 0:
        hp *= 2
    return hp


def _packed_reason(q: torch.Tensor, view: CacheView) -> str | None:
    """None when decode_packed.py can serve this call (else why not)."""
    if q.dtype == torch.float32:  # its dots take fp16 queries (bf16 converts exactly)
        return "float32 queries"
    if not all(isinstance(f, AffineFormat) and f.bits in (4, 8)
               for f in (view.spec.key, view.spec.value)):
        return "decode_packed.py serves int8/int4 K and V"
    if view.head_dim < 64:
        return f"head_dim {view.head_dim} < 64"
    if not _v_pairs(view):
        return "V code rows not 2-byte aligned"
    return _warp_reason(view)


def tile_decode_config(
    q: torch.Tensor, view: CacheView, lengths: torch.Tensor | None = None
) -> LaunchConfig:
    """decode.py's launch (any shape up to 128 packed rows; 4-8 warps per program)."""
    n_q, group = q.shape[2], q.shape[1] // view.num_kv_heads
    half = _half(view.head_dim)
    block_m = max(16, triton.next_power_of_2(group * n_q))
    # measured on the H200 at 128k (docs/KERNELS.md): 128-slot tiles suit fp16; int4
    # with 128-slot folded tiles was faster but failed the fp16 error bound (run 3)
    wide = not any(f.is_quantized for f in (view.spec.key, view.spec.value))
    block_n = 32 if half > 64 else (128 if wide else 64)
    warps = 4 if block_m * half < 64 * 64 else 8
    bh = q.shape[0] * view.num_kv_heads
    tiles = triton.cdiv(max(_max_slots(view, lengths), 1), block_n)
    # ~8 programs per SM keeps a single long sequence streaming at full bandwidth
    want = triton.cdiv(8 * _sm_count(q.device), bh)
    splits = max(1, min(want, triton.cdiv(tiles, 2), 256))
    return LaunchConfig("decode", block_m, block_n, warps, 3, splits, fold=True)


def triton_attention(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    lengths: torch.Tensor | None = None,
    kv_start: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Causal attention of the last L positions' queries over a quantized cache view.

    q:       `[B, H_q, L, D]` fp16/bf16/fp32 (any strides); H_q a multiple of H_kv.
    view:    `cache.view()`; K and V formats may differ (e.g. k8v4).
    scale:   softmax scale, default 1/sqrt(D). softcap: Gemma 2's `c * tanh(s / c)`.
    lengths: optional int32 `[B]` on q's device: each sequence's length, read by the
             kernels at run time (CUDA-graph decode); default `view.length_t` when the
             view carries one, else `view.length` for all.
    kv_start: optional integer `[B]`: each row's first valid key position (left
             padding); keys before it are hidden.
    out:     optional `[B, H_q, L, D]` contiguous output buffer in q.dtype.
    config:  override the heuristic `launch_config` (benchmarks, tuning).
    Returns `[B, H_q, L, D]` in q.dtype.

    Example:
        cache.append(k, v)
        o = triton_attention(q, cache.view(), softcap=50.0)
    """
    if torch.compiler.is_compiling() and out is None and config is None:
        return _attention_op(
            q, *view.k, *view.v, lengths if lengths is not None else view.length_t, kv_start,
            view.spec.name, view.head_dim, view.length, view.sinks, view.ring,
            -1 if view.window is None else view.window, view.dtype,
            -1.0 if scale is None else float(scale), float(softcap or 0.0),
        )
    return _triton_attention(q, view, scale=scale, softcap=softcap, lengths=lengths,
                             kv_start=kv_start, out=out, config=config)


def triton_attention_lse(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    min_distance: int = 0,
    min_key: int = 0,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kvtax.attention.lse.attention_lse` on the fused kernels (one part of a hybrid cache).

    q `[B, H_q, L, D]` (the last L positions) over `view`, which may be Hadamard-rotated
    (`+hk`: q is rotated here; `+hkv`: the output is rotated back). Keys closer than
    `min_distance` to a query, or at positions < `min_key`, are hidden on top of the
    view's causal/window/sink rule. Returns `(out, lse)`: out `[B, H_q, L, D]` float32 in
    the model's value domain, lse `[B, H_q, L]` float32 (natural log of the sum of
    exp(scaled, soft-capped scores)); a row that sees no key has out 0 and lse -inf.
    Raises ShapeError where the kernels cannot serve the call (`unsupported_reason`).

    Example:
        o_fp, l_fp = triton_attention_lse(q, fp16_part_view)
        o_q, l_q = triton_attention_lse(q, body_view, min_distance=128, min_key=4)
        out, _ = merge_lse([(o_fp, l_fp), (o_q, l_q)])
    """
    rows = tuple(q.shape[:3]) if q.dim() == 4 else (0, 0, 0)
    out = _workspace(tuple(q.shape), q.device)  # float32: the merge stays exact
    lse = _workspace(rows, q.device)
    _triton_attention(rotate_query(q, view), view, scale=scale, softcap=softcap, out=out,
                      config=config, lse=lse, min_distance=min_distance, min_key=min_key)
    return unrotate_output(out, view), lse


# torch.compile sees the kernels as one opaque op: Inductor re-specializes user Triton
# kernels it traces (and failed to build them on the H200 with Triton 3.6), and a graph
# break per layer would cut transformers' compiled decode into 64 pieces. Defined with
# torch.library's plain API (one dispatcher hop to the body; `torch.library.custom_op`
# adds ~30 us of Python per call) and inference only: no autograd formula.
_LIB = torch.library.Library("kvtax", "FRAGMENT")
_LIB.define(
    "attention(Tensor q, Tensor kc, Tensor? ks, Tensor? kb, Tensor vc, Tensor? vs, "
    "Tensor? vb, Tensor? length_t, Tensor? kv_start, str spec, SymInt head_dim, SymInt length, "
    "SymInt sinks, SymInt ring, SymInt window, ScalarType dtype, float scale, float softcap) "
    "-> Tensor"
)
# A compiled decode step calls the op once per layer with the same layouts: the launch
# configuration is derived once per layout key, not on every call (issue 5).
_OP_CONFIGS: dict[tuple, LaunchConfig] = {}
_MAX_OP_CONFIGS = 256  # layouts one process sees are few; a bound against leaks


def _layout(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def _attention_body(
    q: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor | None, kb: torch.Tensor | None,
    vc: torch.Tensor, vs: torch.Tensor | None, vb: torch.Tensor | None,
    length_t: torch.Tensor | None, kv_start: torch.Tensor | None, spec: str, head_dim: int,
    length: int, sinks: int, ring: int, window: int, dtype: torch.dtype, scale: float,
    softcap: float,
) -> torch.Tensor:
    view = CacheView(
        k=QTensor(kc, ks, kb), v=QTensor(vc, vs, vb), spec=_spec(spec), head_dim=head_dim,
        length=length, sinks=sinks, ring=ring, window=None if window < 0 else window,
        dtype=dtype, length_t=length_t,
    )
    key = (spec, head_dim, length, sinks, ring, window, dtype, _layout(q), _layout(length_t),
           kv_start is None, *(_layout(t) for t in (kc, ks, kb, vc, vs, vb)))
    config = _OP_CONFIGS.get(key)
    if config is None and _unsupported(q, view, allow_cpu=_interpreting()) is None:
        if len(_OP_CONFIGS) >= _MAX_OP_CONFIGS:
            _OP_CONFIGS.clear()
        config = _OP_CONFIGS[key] = launch_config(q, view, length_t)
    return _triton_attention(q, view, scale=None if scale < 0 else scale,
                             softcap=softcap or None, kv_start=kv_start, config=config)


def _attention_fake(q, kc, ks, kb, vc, vs, vb, length_t, kv_start, spec, head_dim, length,
                    sinks, ring, window, dtype, scale, softcap):
    return q.new_empty(q.shape)


for _key in ("CPU", "CUDA"):  # CPU: Triton's interpreter (tests)
    _LIB.impl("attention", _attention_body, _key)
torch.library.register_fake("kvtax::attention", _attention_fake, lib=_LIB)
_attention_op = torch.ops.kvtax.attention.default


@lru_cache(maxsize=None)
def _spec(name: str) -> KVSpec:
    return KVSpec.parse(name)


def _triton_attention(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    lengths: torch.Tensor | None = None,
    kv_start: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
    lse: torch.Tensor | None = None,
    min_distance: int = 0,
    min_key: int = 0,
) -> torch.Tensor:
    """The launches. Besides `triton_attention`'s arguments (`out` may also be float32):
    lse: optional contiguous float32 `[B, H_q, L]`, filled with each row's log-sum-exp;
    min_distance / min_key: hide keys closer than that to the query, or before that
    position (`attention_lse`'s masks). Both off by default (the plain kernel variants)."""
    reason = _unsupported(q, view, allow_cpu=_interpreting())
    if reason is not None:
        raise ShapeError(f"triton_attention cannot run this call: {reason}")
    n_q, group = check_query(q, view)
    b, h_q, _, d = q.shape
    h_kv = view.num_kv_heads
    if lengths is None:
        lengths = getattr(view, "length_t", None)
    if kv_start is not None:
        kv_start = check_kv_start(kv_start, view).to(torch.int32)
    if lengths is not None:
        if lengths.dtype != torch.int32 or lengths.shape != (b,) or lengths.device != q.device:
            raise ShapeError(
                f"lengths must be int32 [{b}] on {q.device}, got {lengths.dtype} "
                f"{tuple(lengths.shape)} on {lengths.device}"
            )
        lengths = lengths.contiguous()
    if out is None:
        out = torch.empty((b, h_q, n_q, d), dtype=q.dtype, device=q.device)
    elif (out.shape != q.shape or out.dtype not in (q.dtype, torch.float32)
          or not out.is_contiguous()):
        raise ShapeError(f"out must be contiguous {tuple(q.shape)} {q.dtype} (or float32)")
    if lse is not None and (lse.shape != (b, h_q, n_q) or lse.dtype != torch.float32
                            or not lse.is_contiguous() or lse.device != q.device):
        raise ShapeError(f"lse must be contiguous float32 {(b, h_q, n_q)} on {q.device}")
    if not 0 <= min_distance < 2**31 or not 0 <= min_key < 2**31:
        raise ShapeError(f"min_distance {min_distance}, min_key {min_key} must be in [0, 2^31)")
    if n_q == 0 or b == 0:
        return out
    cfg = config or launch_config(
        q, view, lengths, softcap=bool(softcap),
        masked=bool(min_distance or min_key or kv_start is not None))

    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    log2e = 1.4426950408889634
    if softcap:
        qk_scale, cap_log2 = scale / softcap, softcap * log2e
    else:
        qk_scale, cap_log2 = scale * log2e, 0.0
    k_fmt, k_gs = _format_code(view.spec.key)  # type: ignore[misc]
    v_fmt, v_gs = _format_code(view.spec.value)  # type: ignore[misc]
    kc, ks, kb = _parts(view.k)
    vc, vs, vb = _parts(view.v)
    common = dict(
        G=group, HEAD_DIM=d, HALF=_half(d), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        K_FMT=k_fmt, K_GS=max(k_gs, 1), V_FMT=v_fmt, V_GS=max(v_gs, 1),
        IS_RING=view.ring > 0, HAS_WINDOW=view.window is not None, SOFTCAP=bool(softcap),
        HAS_LENS=lengths is not None, IEEE=_ieee_dots(q.dtype),
        FOLD_K=cfg.fold and _fold_pays(view.spec.key, d),
        FOLD_V=cfg.fold and _fold_pays(view.spec.value, d), F16_MATH=cfg.f16_math,
        HAS_KV_START=kv_start is not None, HAS_MIN_DIST=bool(min_distance or min_key),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # hybrid-cache parts (triton_attention_lse): extra masks, per-row log-sum-exp
    masks = dict(min_dist=min_distance, min_key=min_key)
    lse_args = dict(Lse=lse if lse is not None else out, HAS_LSE=lse is not None)
    scalars = (
        view.length, n_q, h_kv, view.sinks, max(view.ring, 1),
        view.window if view.window is not None else 0, qk_scale, cap_log2,
    )
    cache_args = (
        kc, ks, kb, vc, vs, vb, lengths if lengths is not None else kc,
        kv_start if kv_start is not None else kc,
    )
    strides = (
        *kc.stride()[:3], *_meta_stride(ks, kb), *vc.stride()[:3], *_meta_stride(vs, vb),
    )
    if cfg.path == "prefill":
        grid = (triton.cdiv(group * n_q, cfg.block_m), b * h_kv)
        _prefill_attn_fwd_kernel[grid](
            q, out, *cache_args, *scalars, *q.stride(), *out.stride()[:3], *strides,
            **masks, **lse_args, **common,
        )
        return out

    rows, splits = group * n_q, cfg.num_splits
    part_o = _workspace((b * h_kv, splits, rows, d), q.device)
    part_m = _workspace((b * h_kv, splits, rows), q.device)
    part_l = _workspace((b * h_kv, splits, rows), q.device)
    if cfg.kernel == "packed":
        hp = cfg.heads_per_program
        reason = _packed_reason(q, view)
        if reason is None and (min_distance or min_key):
            reason = "hybrid-cache masks (min_distance / min_key) are decode_warp.py's"
        if reason is not None or h_kv % hp or hp * rows > cfg.block_m:
            raise ShapeError(f"decode_packed kernel cannot run this call: {reason or 'rows'}")
        args = {**{k: common[k] for k in _ONE_WARP_KEYS}, "IEEE": False}  # fp16 dots
        _decode_packed_kernel[(b * h_kv // hp, splits)](
            q, part_o, part_m, part_l, *cache_args, scalars[0], n_q, splits, *scalars[2:],
            *q.stride(), *strides, HP=hp, K_NG=d // view.spec.key.group_size,
            V_NG=d // view.spec.value.group_size, ASM=not _interpreting(), **args,
        )
    elif cfg.kernel == "swap":
        # launch_config picks "swap" only where the Gluon kernel serves the call (checked
        # there, once per call); a caller's explicit config is checked here
        if config is not None:
            reason = swap_reason(q, view)
            if reason is None and (min_distance or min_key or kv_start is not None):
                reason = "hybrid-cache masks / left padding are decode_warp.py's"
            if reason is not None:
                raise ShapeError(f"decode_swap kernel cannot run this call: {reason}")
        if config is None or (not softcap and gluon_swap_reason(q, view) is None):
            _launch_swap_gluon(q, view, part_o, part_m, part_l, lengths, qk_scale, splits,
                               cfg)
        else:
            _launch_swap_triton(q, view, part_o, part_m, part_l, cache_args, scalars[0],
                                qk_scale, cap_log2, strides, splits, softcap, lengths, cfg,
                                k_fmt, v_fmt)
    elif cfg.kernel == "warp":
        reason = _warp_reason(view)
        if reason is not None or cfg.block_m < rows:
            raise ShapeError(f"decode_warp kernel cannot run this call: {reason or 'rows'}")
        _decode_warp_kernel[(b * h_kv, splits)](
            q, part_o, part_m, part_l, *cache_args, scalars[0], n_q, splits, *scalars[2:],
            *q.stride(), *strides, **masks, HAS_MIN_DIST=common["HAS_MIN_DIST"],
            **_warp_args(view, q.dtype, cfg, common), **_pdl("attention", q, cfg),
        )
    else:
        _decode_attn_split_kernel[(b * h_kv, splits)](
            q, part_o, part_m, part_l, *cache_args, scalars[0], n_q, splits, *scalars[2:],
            *q.stride(), *strides, **masks, **common, **_pdl("attention", q, cfg),
        )
    splits_pad = triton.next_power_of_2(splits)
    d_block = min(32, triton.next_power_of_2(d))
    _decode_attn_reduce_kernel[(b * h_kv, rows, triton.cdiv(d, d_block))](
        part_o, part_m, part_l, out, n_q, splits, h_kv, *out.stride()[:3], **lse_args,
        G=group, HEAD_DIM=d, D_BLOCK=d_block,
        # all splits in one shot up to 256 (a [256, 32] float32 tile over 4 warps)
        SPLITS_PAD=splits_pad, SPLIT_BLOCK=splits_pad if splits_pad <= 256 else 64,
        num_warps=4, **_pdl("reduce", q),
    )
    return out


def _launch_swap_triton(q, view, part_o, part_m, part_l, cache_args, length_host, qk_scale,
                        cap_log2, strides, splits, softcap, lengths, cfg, k_fmt,
                        v_fmt) -> None:
    """decode_swap.py (the Triton twin: any `swap_reason` case, soft-capping too)."""
    d, b, h_kv = view.head_dim, q.shape[0], view.num_kv_heads
    _decode_swap_kernel[(b * h_kv, splits)](
        q, part_o, part_m, part_l, *cache_args[:7], length_host, q.shape[2], splits, h_kv,
        qk_scale, cap_log2, *q.stride(), *strides,
        G=q.shape[1] // h_kv, HEAD_DIM=d, K_FMT=k_fmt, K_NG=d // view.spec.key.group_size,
        V_FMT=v_fmt, V_NG=d // view.spec.value.group_size, SOFTCAP=bool(softcap),
        HAS_LENS=lengths is not None, ASM=not _interpreting(), LAZY=cfg.lazy, num_warps=1,
        num_stages=cfg.num_stages, **_pdl("attention", q, cfg),
    )


def _launch_swap_gluon(q, view, part_o, part_m, part_l, lengths, qk_scale, splits,
                       cfg) -> None:
    """decode_swap_gluon.py: scales and biases as 32-bit words (one slot's lo / hi pair;
    `swap_reason` checked their alignment), V codes as uint16 pairs."""
    import triton.experimental.gluon.language as gl

    b, h_kv = q.shape[0], view.num_kv_heads
    kc, ks, kb = _parts(view.k)
    vc, vs, vb = _parts(view.v)
    words = [t.view(torch.int32)[..., 0] for t in (ks, kb, vs, vb)]
    vc16 = vc.view(torch.int16)
    _gluon_swap_kernel()[(b * h_kv, splits)](
        q, part_o, part_m, part_l, kc, vc16, *words,
        lengths if lengths is not None else kc, view.length, q.shape[2], splits, h_kv,
        qk_scale, *q.stride(), *kc.stride()[:3], *words[0].stride()[:2],
        *vc16.stride()[:3], *words[2].stride()[:2],
        G=q.shape[1] // h_kv, D=view.head_dim, STAGES=cfg.num_stages,
        MDT=gl.float16 if q.dtype == torch.float16 else gl.bfloat16,
        INT4=view.spec.key.n_bits == 4, HAS_LENS=lengths is not None, LAZY=cfg.lazy,
        num_warps=1, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
        **_pdl("attention", q, cfg),
    )


# the launch-wide constexprs decode_warp.py and decode_packed.py take from `common`
_ONE_WARP_KEYS = ("G", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "K_FMT", "V_FMT", "IS_RING",
                  "HAS_WINDOW", "SOFTCAP", "HAS_LENS", "IEEE", "HAS_KV_START", "num_warps",
                  "num_stages")


def _warp_reason(view: CacheView) -> str | None:
    """None when decode_warp.py serves this cache: head dim a power of two from 32 to
    256, integer formats with at most one scale group per half row (group >= D/2) and
    packed scale rows. Otherwise the tile kernel (decode.py) runs."""
    d = view.head_dim
    if d & (d - 1) or not 32 <= d <= 256:
        return f"head_dim {d} is not a power of two in [32, 256]"
    for part, fmt, qt in (("key", view.spec.key, view.k), ("value", view.spec.value, view.v)):
        if isinstance(fmt, AffineFormat):
            if fmt.group_size < d // 2:
                return f"{part} group size {fmt.group_size} < head_dim / 2"
            if qt.scales.stride(-2) != d // fmt.group_size:
                return f"{part} scale rows are not packed"
    return None


def _warp_args(view: CacheView, dtype: torch.dtype, cfg: LaunchConfig, common: dict) -> dict:
    """decode_warp.py's constexprs (its operand dtypes and groups per row) and launch."""
    import triton.language as tl

    tl_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
    ieee = common["IEEE"]

    def side(fmt: KVFormat) -> tuple[int, object]:
        code, gs = _format_code(fmt)  # type: ignore[misc]
        ng = view.head_dim // gs if code in (1, 2) else 1
        if ieee:
            dt = tl.float32
        elif code == 0:  # stored rows go to the dots as they are
            dt = tl_dtype[view.k.codes.dtype if fmt is view.spec.key else view.v.codes.dtype]
        else:  # centered codes and fp8 values are exact in fp16
            dt = tl.float16
        return ng, dt

    k_ng, k_dt = side(view.spec.key)
    v_ng, v_dt = side(view.spec.value)
    args = {k: common[k] for k in _ONE_WARP_KEYS}
    args.update(K_NG=k_ng, V_NG=v_ng, K_DT=k_dt, V_DT=v_dt, ASM=not _interpreting(),
                V_PAIRS=cfg.v_pairs and _v_pairs(view), LAZY=cfg.lazy, STRIDED=cfg.strided)
    if cfg.maxnreg and not _interpreting():
        args["maxnreg"] = cfg.maxnreg
    return args


def _v_pairs(view: CacheView) -> bool:
    """Read int8/int4 V tiles as uint16 pairs of dims (decode_warp.py's `_v_pairs`):
    needs D/4 >= 16 (the MMA's smallest N) and 2-byte aligned code rows."""
    codes = view.v.codes
    return (isinstance(view.spec.value, AffineFormat) and view.head_dim >= 64
            and codes.data_ptr() % 2 == 0 and all(s % 2 == 0 for s in codes.stride()[:-1]))


def _fold_pays(fmt: KVFormat, head_dim: int) -> bool:
    """Move scales off the elements (decode) for fp8 and for int4 whose half-rows each lie
    in one scale group; int8 measured faster dequantizing per element (docs/KERNELS.md)."""
    if isinstance(fmt, FP8Format):
        return True
    half = head_dim // 2
    return _is_int4(fmt) and fmt.group_size >= half and _half(head_dim) == half


def _is_int4(fmt: KVFormat) -> bool:
    return isinstance(fmt, AffineFormat) and fmt.n_bits == 4


def _ieee_dots(dtype: torch.dtype) -> bool:
    """float32 dots for fp32 models, and for bf16 under the interpreter, whose bf16
    tl.dot is broken (Triton 3.9 returns garbage); compiled bf16 keeps bf16 dots."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _interpreting())


def _parts(qt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes, scales, biases; absent parts alias codes (the kernels never read them).
    fp8-pt (fp8 codes, no scales) reads fp8's kernel path with a stride-0 scale of 1.0."""
    codes = qt.codes
    scales = qt.scales
    if codes.dtype == torch.float8_e4m3fn:
        if scales is None:
            scales = _unit_scale(codes.device).expand(*codes.shape[:-1], 1)
        codes = codes.view(torch.uint8)
    scales = scales if scales is not None else codes
    biases = qt.biases if qt.biases is not None else scales
    return codes, scales, biases


@lru_cache(maxsize=None)
def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 per device, kept (a captured decode graph keeps pointing at it)."""
    return torch.ones((), dtype=torch.float32, device=device)


def _meta_stride(scales: torch.Tensor, biases: torch.Tensor) -> tuple[int, int, int]:
    return tuple(scales.stride()[:3])  # type: ignore[return-value]


def _workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if POISON_WORKSPACE:
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)
    return torch.empty(shape, dtype=torch.float32, device=device)
