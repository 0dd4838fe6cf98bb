"""Checked entry point of the fused quantize-and-store kernel (`kernels/quantize.py`).

    >>> from kvtax.formats import store_triton
    >>> store_triton.unsupported_reason(k, v, store.k, store.v, spec)    # None: it can run
    >>> store_triton.quantize_store(k, v, store.k, store.v, spec, pos)   # pos: int or [1] tensor

`quantize_store` writes into the storage exactly what `spec.key.quantize(k)` and
`spec.value.quantize(v)` give (after the Hadamard rotation of +hk / +hkv specs, done in
torch), in one kernel launch for K and V together; with `pos` a device tensor nothing is
read back to the host, so a CUDA graph can capture it. Token t goes to the slot of
position pos + t: slot pos + t, or under a ring (SlidingCache) the ring's slot.

On CPU the kernel runs only when Triton's interpreter built it (`TRITON_INTERPRET=1` when
this module was first imported; how the tests run it); `unsupported_reason` says so.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvtax import pdl
from kvtax.errors import FormatError, ShapeError
from kvtax.formats.affine import AffineFormat
from kvtax.formats.base import MODEL_DTYPES, KVFormat, QTensor
from kvtax.formats.floats import FloatFormat
from kvtax.formats.fp8 import E4M3_MAX, FP8Format, FP8TensorFormat
from kvtax.formats.kernels.quantize import quantize_store_kernel
from kvtax.formats.mutating_op import mutating_op
from kvtax.formats.rotation import rotate
from kvtax.formats.spec import KVSpec

MAX_HEAD_DIM = 1024  # one row is one tile
# Launch override for benchmarks/quantize.py's variants: (rows per program, warps) or None
# for the heuristic in `_plan`. Plans are cached per layout: clear `_OP_PLANS` after a change.
LAUNCH_OVERRIDE: tuple[int, int] | None = None
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@lru_cache(maxsize=None)
def f32_reciprocal(divisor: float) -> float:
    """float32(1 / divisor), computed in float32 as ATen's CUDA division by a scalar does."""
    one, div = (torch.tensor(x, dtype=torch.float32) for x in (1.0, divisor))
    return float(one / div)


def _interpreting() -> bool:
    """True when Triton's interpreter built the kernel (then it also runs on CPU tensors)."""
    return type(quantize_store_kernel).__name__ == "InterpretedFunction"


def format_code(fmt: KVFormat) -> tuple[int, int, float] | None:
    """(kernel format code, group size, divisor of the scale) or None: no kernel for it."""
    if isinstance(fmt, FloatFormat):
        return 0, 0, 1.0
    if isinstance(fmt, AffineFormat):
        if fmt.n_bits == 3:  # the store kernel packs 8- and 4-bit codes only
            return None
        return (1 if fmt.n_bits == 8 else 2), fmt.group_size, float(fmt.levels)
    if isinstance(fmt, FP8TensorFormat):  # before FP8Format: a subclass, with no scales
        return 4, 0, 1.0
    if isinstance(fmt, FP8Format):
        return 3, 0, E4M3_MAX
    return None


def unsupported_reason(
    k: torch.Tensor,
    v: torch.Tensor,
    k_dst: QTensor,
    v_dst: QTensor,
    spec: KVSpec,
    *,
    pos: int | torch.Tensor = 0,
    ring: int = 0,
    sinks: int = 0,
) -> str | None:
    """None when `quantize_store` can serve this call, else why not (the caller falls back
    to `fmt.quantize` + a copy). Arguments as for `quantize_store`."""
    if not (k.is_cuda or _interpreting()):
        return "tensors are not on a CUDA device (on CPU the kernel runs only interpreted)"
    if k.dim() != 4 or k.shape != v.shape:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} must be one [B, H, T, D] shape"
    if k.dtype not in MODEL_DTYPES or v.dtype != k.dtype or v.device != k.device:
        return (f"k, v must share a float16/bfloat16/float32 dtype and a device "
                f"({k.dtype}, {v.dtype})")
    b, h, t, d = k.shape
    if not 2 <= d <= MAX_HEAD_DIM:
        return f"head_dim {d} (the kernel takes 2..{MAX_HEAD_DIM})"
    for part, fmt, dst in (("key", spec.key, k_dst), ("value", spec.value, v_dst)):
        if format_code(fmt) is None:
            return f"{part} format {fmt.name} has no kernel"
        try:
            fmt.check(d)
        except FormatError as exc:  # the torch path raises it to the user
            return str(exc)
        widths = (fmt.code_width(d), fmt.scale_width(d), fmt.bias_width(d))
        dtypes = (fmt.code_dtype(k.dtype), k.dtype, k.dtype)
        for name, got, width, dtype in zip(("codes", "scales", "biases"), dst, widths, dtypes):
            if (got is None) != (width == 0):
                return f"{part} storage {name} do not match format {fmt.name}"
            if got is None:
                continue
            if got.dim() != 4 or tuple(got.shape[:2]) != (b, h) or got.shape[3] != width:
                return f"{part} storage {name} shape {tuple(got.shape)} does not fit {(b, h, d)}"
            if got.dtype != dtype or got.device != k.device or got.stride(-1) != 1:
                return f"{part} storage {name} must be {dtype} rows on {k.device}, contiguous"
        sc, bi = dst.scales, dst.biases
        if sc is not None and bi is not None and sc.stride() != bi.stride():
            return f"{part} storage scales and biases have different strides"
    if isinstance(pos, torch.Tensor):
        int_dtype = pos.dtype in (torch.int32, torch.int64)
        if pos.numel() != 1 or not int_dtype or pos.device != k.device:
            return "a device position must be one int32/int64 element on the tensors' device"
        in_ring = t  # unknown on the host: every token may land in the ring
    else:
        in_ring = t - max(0, min(sinks - pos, t))
    if ring and in_ring > ring:
        return f"{in_ring} tokens do not fit a ring of {ring} slots"
    if not ring and not isinstance(pos, torch.Tensor) and pos + t > k_dst.codes.shape[2]:
        return f"positions up to {pos + t} exceed the storage's {k_dst.codes.shape[2]} slots"
    return None


def quantize_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_dst: QTensor,
    v_dst: QTensor,
    spec: KVSpec,
    pos: int | torch.Tensor,
    *,
    sinks: int = 0,
    ring: int = 0,
    check: bool = True,
    recip: bool | None = None,
) -> None:
    """Quantize `k`, `v` `[B, H, T, D]` with `spec` and write them into storage.

    k_dst / v_dst: the cache's storage, each part `[B, H, capacity, width]` (see
    `KVFormat.allocate`). Token t goes to position `pos + t`, stored at slot `pos + t`,
    or, with `ring > 0`, at `pos + t` below `sinks` and `sinks + (pos + t - sinks) % ring`
    above. `pos`: a host int, or an int `[1]` tensor on the tensors' device (read by the
    kernel: CUDA-graph safe). `check=False` skips `unsupported_reason` (callers that just
    ran it). `recip` (tests): scale division as ATen does it on CUDA (True) or CPU (False);
    default: as on the tensors' device.
    """
    if torch.compiler.is_compiling():
        from_ptr = isinstance(pos, torch.Tensor)
        _store_op(k, v, *k_dst, *v_dst, spec.name, pos if from_ptr else None,
                  0 if from_ptr else int(pos), sinks, ring, check)
        return
    _quantize_store(k, v, k_dst, v_dst, spec, pos, sinks=sinks, ring=ring, check=check,
                    recip=recip)


# torch.compile sees the store as one opaque op that writes the cache storage
# (kvtax.formats.mutating_op says why).
_SCHEMA = (
    "quantize_store(Tensor k, Tensor v, Tensor(a2!) kc, Tensor(a3!)? ks, Tensor(a4!)? kb, "
    "Tensor(a5!) vc, Tensor(a6!)? vs, Tensor(a7!)? vb, str spec, Tensor? pos_t, SymInt pos0, "
    "SymInt sinks, SymInt ring, bool check) -> ()"
)


def _store_body(
    k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor | None,
    kb: torch.Tensor | None, vc: torch.Tensor, vs: torch.Tensor | None,
    vb: torch.Tensor | None, spec: str, pos_t: torch.Tensor | None, pos0: int, sinks: int,
    ring: int, check: bool,
) -> None:
    if pos_t is not None and not check:
        _op_store(k, v, QTensor(kc, ks, kb), QTensor(vc, vs, vb), spec, pos_t, sinks, ring)
        return
    _quantize_store(k, v, QTensor(kc, ks, kb), QTensor(vc, vs, vb), spec_named(spec),
                    pos_t if pos_t is not None else pos0, sinks=sinks, ring=ring, check=check)


_store_op = mutating_op(_SCHEMA, _store_body)


@lru_cache(maxsize=None)
def spec_named(name: str) -> KVSpec:
    return KVSpec.parse(name)


def _quantize_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_dst: QTensor,
    v_dst: QTensor,
    spec: KVSpec,
    pos: int | torch.Tensor,
    *,
    sinks: int = 0,
    ring: int = 0,
    check: bool = True,
    recip: bool | None = None,
) -> None:
    if check:
        reason = unsupported_reason(k, v, k_dst, v_dst, spec, pos=pos, sinks=sinks, ring=ring)
        if reason is not None:
            raise ShapeError(f"fused quantize-and-store cannot run: {reason}")
    k = rotate(k) if spec.rotate_keys else k
    v = rotate(v) if spec.rotate_values else v
    # rows are read with the last dim contiguous
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if k.shape[0] * k.shape[1] * k.shape[2] == 0:
        return
    recip = k.is_cuda if recip is None else recip
    _launch(_plan(k, v, k_dst, v_dst, spec, isinstance(pos, torch.Tensor), sinks, ring, recip),
            k, v, k_dst, v_dst, pos)


class _Plan(NamedTuple):
    """Everything of one launch that the tensors' shapes, strides and dtypes decide."""

    grid: tuple[int, int]
    scalars: tuple  # sinks, ring, rows, t, h
    sides: tuple  # per side (K, V): (x strides, codes/meta strides, 1/divisor)
    consts: dict  # constexprs and launch options
    from_ptr: bool


def _plan(
    k: torch.Tensor, v: torch.Tensor, k_dst: QTensor, v_dst: QTensor, spec: KVSpec,
    from_ptr: bool, sinks: int, ring: int, recip: bool,
) -> _Plan:
    b, h, t, d = k.shape
    kf, vf = format_code(spec.key), format_code(spec.value)
    assert kf is not None and vf is not None
    d_p = triton.next_power_of_2(d)
    rows = b * h * t
    budget = 16384 if _interpreting() else 2048  # elements per program; fewer in the interpreter
    block_r = max(1, min(triton.next_power_of_2(rows), budget // d_p))
    warps = 4
    if rows <= 64 and (kf[0] != 0 or vf[0] != 0) and not _interpreting():
        # a decode step's few quantized rows: one row per one-warp program (group min/max
        # by warp shuffles, no shared memory): H200, 32 layers of one int8 token each,
        # 0.063 vs 0.172 ms per step (benchmarks/quantize.py --launches)
        block_r, warps = 1, 1
    if LAUNCH_OVERRIDE is not None:
        block_r, warps = LAUNCH_OVERRIDE
    sides = []
    for x, dst, (_, gs, div) in ((k, k_dst, kf), (v, v_dst, vf)):
        m_strides = dst.scales.stride()[:3] if dst.scales is not None else (0, 0, 0)
        sides.append((tuple(x.stride()[:3]), (*dst.codes.stride()[:3], *m_strides),
                      f32_reciprocal(div)))
    consts = dict(
        HEAD_DIM=d, DT=TL_DTYPES[k.dtype],
        K_FMT=kf[0], K_GS=max(kf[1], 1), K_OUT=out_dtype(spec.key, k.dtype),
        K_NG_P=triton.next_power_of_2(d // kf[1]) if kf[1] else 1,
        V_FMT=vf[0], V_GS=max(vf[1], 1), V_OUT=out_dtype(spec.value, k.dtype),
        V_NG_P=triton.next_power_of_2(d // vf[1]) if vf[1] else 1,
        POS_FROM_PTR=from_ptr, IS_RING=ring > 0, RECIP=recip,
        BLOCK_R=block_r, D_P=d_p, HALF_P=triton.next_power_of_2(max(d // 2, 1)),
        num_warps=warps, enable_fp_fusion=False,  # no FMA contraction: torch rounds each op
    )
    return _Plan((triton.cdiv(rows, block_r), 2), (sinks, ring, rows, t, h), tuple(sides),
                 consts, from_ptr)


def _launch(
    plan: _Plan, k: torch.Tensor, v: torch.Tensor, k_dst: QTensor, v_dst: QTensor,
    pos: int | torch.Tensor,
) -> None:
    args: list = []
    for x, dst, (x_strides, d_strides, recip) in zip((k, v), (k_dst, v_dst), plan.sides):
        codes = dst.codes.view(torch.uint8) if dst.codes.dtype == torch.float8_e4m3fn else dst.codes
        meta = dst.scales if dst.scales is not None else codes  # placeholders are never read
        bias = dst.biases if dst.biases is not None else meta
        args += [x, *x_strides, codes, meta, bias, *d_strides, recip]
    quantize_store_kernel[plan.grid](
        pos if plan.from_ptr else k, 0 if plan.from_ptr else int(pos), *plan.scalars, *args,
        **plan.consts, **pdl.launch_options("store", k, _interpreting()),
    )


# The compiled graph calls the op once per layer per decode step with the same layouts:
# its checked plan is kept per (spec, layouts) key, so a call costs a dict lookup and a
# launch instead of re-validating and re-deriving ~30 launch arguments (it showed in compiled transformers decode).
_OP_PLANS: dict[tuple, _Plan] = {}
_MAX_OP_PLANS = 256  # layouts seen by one process are few; a bound against leaks


def _layout(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _op_store(
    k: torch.Tensor, v: torch.Tensor, k_dst: QTensor, v_dst: QTensor, spec_name: str,
    pos_t: torch.Tensor, sinks: int, ring: int,
) -> None:
    """The op body for a device position: the cached plan of these layouts, then a launch."""
    key = (spec_name, sinks, ring, _layout(k), _layout(v), _layout(pos_t),
           *(_layout(t) for t in (*k_dst, *v_dst)))
    plan = _OP_PLANS.get(key)
    if plan is None:
        spec = spec_named(spec_name)
        rows = k.shape[0] * k.shape[1] * k.shape[2]
        if spec.rotate_keys or spec.rotate_values or not rows or k.stride(-1) != 1 \
                or v.stride(-1) != 1:  # rotation/copies are per call: the full checked path
            _quantize_store(k, v, k_dst, v_dst, spec, pos_t, sinks=sinks, ring=ring)
            return
        reason = unsupported_reason(k, v, k_dst, v_dst, spec, pos=pos_t, sinks=sinks, ring=ring)
        if reason is not None:
            raise ShapeError(f"fused quantize-and-store cannot run: {reason}")
        if len(_OP_PLANS) >= _MAX_OP_PLANS:
            _OP_PLANS.clear()
        plan = _OP_PLANS[key] = _plan(k, v, k_dst, v_dst, spec, True, sinks, ring, k.is_cuda)
    _launch(plan, k, v, k_dst, v_dst, pos_t)


def out_dtype(fmt: KVFormat, model_dtype: torch.dtype) -> tl.dtype:
    """Element type the kernel stores codes as (fp8 codes go out as their uint8 bits)."""
    dt = fmt.code_dtype(model_dtype)
    return TL_DTYPES.get(dt, tl.uint8)
