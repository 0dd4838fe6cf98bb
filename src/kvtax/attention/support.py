"""Which fused kernel can serve a call: the checks behind dispatch and the launch table.

Each function answers None (this kernel serves the call) or a one-line reason it does
not; `unsupported_reason` is the gate of every kernel path, `warp_reason`, `swap_reason`
and `gluon_swap_reason` choose among the decode kernels.
"""

from __future__ import annotations

import torch
import triton

from kvtax.attention.kernels.decode import decode_attn_split_kernel
from kvtax.attention.view import CacheView
from kvtax.formats import AffineFormat, ChannelBlockFormat, FloatFormat, FP8Format, KVFormat
from kvtax.formats.widest import WidestBitFormat, selected

Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when these kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at
    import): then triton_attention also runs on CPU tensors (how CI tests the kernels)."""
    return type(decode_attn_split_kernel).__name__ == "InterpretedFunction"


def format_code(fmt: KVFormat) -> tuple[int, int] | None:
    """(kernel format code, group size) or None when the kernels don't know the format:
    0 float, 1 int8, 2 int4, 3 fp8 e4m3, 4 int4-c64, 5 int3-c64 and 7 int4w-c64 (keys
    only; their group is the 64-token block), 6 int3 (3-bit bit planes, per-token groups),
    group size 0 where there are no groups (kernels/dequant.py reads each)."""
    if isinstance(fmt, WidestBitFormat):
        return 7, fmt.block
    if isinstance(fmt, ChannelBlockFormat):
        return (4 if fmt.n_bits == 4 else 5), fmt.block
    if isinstance(fmt, FloatFormat):
        return 0, 0
    if isinstance(fmt, AffineFormat):
        return {8: 1, 4: 2, 3: 6}[fmt.n_bits], fmt.group_size
    if isinstance(fmt, FP8Format):
        return 3, 0
    return None


def is_three_bit(fmt: KVFormat) -> bool:
    """int3 / int3-c64: codes in bit planes, which only the tile kernels (decode.py,
    prefill.py) unpack; the one-warp and swap decode kernels refuse them."""
    return isinstance(fmt, (AffineFormat, ChannelBlockFormat)) and fmt.n_bits == 3


def three_bit_reason(view: CacheView) -> str | None:
    """Why the one-warp and swap decode kernels refuse this cache's 3-bit K or V, or None."""
    for part, fmt in (("key", view.spec.key), ("value", view.spec.value)):
        if is_three_bit(fmt):
            return f"{part} format {fmt.name}: 3-bit codes are read by the tile kernel"
    return None


def is_int4(fmt: KVFormat) -> bool:
    return isinstance(fmt, AffineFormat) and fmt.n_bits == 4


def half_width(head_dim: int) -> int:
    """The kernels' half-row tile width: D/2 rounded up to a power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim // 2))


def unsupported_reason(q: torch.Tensor, view: CacheView, *, allow_cpu: bool = False) -> str | None:
    """None when the kernels can serve `triton_attention(q, view)` on CUDA (or, with
    `allow_cpu`, on CPU tensors through the interpreter), else why not."""
    if not (q.is_cuda or allow_cpu):
        return "tensors are not on a CUDA device"
    if q.dtype not in Q_DTYPES:
        return f"query dtype {q.dtype} (the kernels take float16, bfloat16, float32)"
    d = view.head_dim
    if d % 2 or not 16 <= d <= 256:
        return f"head_dim {d} (the kernels take even head dims from 16 to 256)"
    for part, fmt in (("key", view.spec.key), ("value", view.spec.value)):
        if format_code(fmt) is None:
            return f"{part} format {fmt.name} has no kernel"
    reason = channel_keys_reason(view)
    if reason is not None:
        return reason
    for qt in (view.k, view.v):
        if any(t.stride(-1) != 1 for t in qt.parts()):
            return "cache storage rows are not contiguous (last stride != 1)"
        if qt.scales is not None and qt.biases is not None and qt.scales.stride() != qt.biases.stride():
            return "cache scales and biases have different strides"
    if q.dim() == 4 and q.shape[0] * view.num_kv_heads >= 2**31:
        return "batch * kv_heads too large for the launch grid"
    return None


def channel_keys_reason(view: CacheView) -> str | None:
    """None unless a channel-block format (int4-c64, int3-c64) is in the spec and the
    kernels cannot read it: they take it for keys only, at head_dim 64 / 128 / 256 (whole
    power-of-two half rows), from block-aligned storage whose metadata rows are packed
    (block j's D values at j * D)."""
    k_fmt, d = view.spec.key, view.head_dim
    if isinstance(view.spec.value, ChannelBlockFormat):
        return (f"value format {view.spec.value.name} has no kernel (the kernels read it "
                "for keys only)")
    if not isinstance(k_fmt, ChannelBlockFormat):
        return None
    if d not in (64, 128, 256):
        return f"{k_fmt.name} keys at head_dim {d} (the kernels take 64, 128 and 256)"
    if isinstance(k_fmt, WidestBitFormat) and selected(d) != 3 * d // 8:
        return f"{k_fmt.name} keys select {selected(d)} channels (kernels/widest.py reads 3D/8)"
    codes, scales, biases = view.k.codes, view.k.scales, view.k.biases
    if codes.shape[2] % k_fmt.block:
        return f"{k_fmt.name} key storage of {codes.shape[2]} slots is not block-aligned"
    if scales.stride(-1) != 1 or scales.stride(-2) != d // k_fmt.block or \
            biases.stride() != scales.stride():
        return f"{k_fmt.name} key scale rows are not packed"
    return None


def warp_reason(view: CacheView) -> str | None:
    """None when decode_warp.py serves this cache: head dim a power of two from 32 to
    256, 8- or 4-bit integer formats with at most one scale group per half row (group >=
    D/2) and packed scale rows (int4-c64 keys: `channel_keys_reason`'s). Otherwise the
    tile kernel (decode.py) runs (3-bit codes always)."""
    d = view.head_dim
    if d & (d - 1) or not 32 <= d <= 256:
        return f"head_dim {d} is not a power of two in [32, 256]"
    reason = three_bit_reason(view)
    if reason is not None:
        return reason
    for part, fmt, qt in (("key", view.spec.key, view.k), ("value", view.spec.value, view.v)):
        if isinstance(fmt, AffineFormat):
            if fmt.group_size < d // 2:
                return f"{part} group size {fmt.group_size} < head_dim / 2"
            if qt.scales.stride(-2) != d // fmt.group_size:
                return f"{part} scale rows are not packed"
    return None


def v_pairs(view: CacheView) -> bool:
    """Read int8/int4 V tiles as uint16 pairs of dims (decode_warp.py's `v_pair_operands`):
    needs D/4 >= 16 (the MMA's smallest N) and 2-byte aligned code rows."""
    codes = view.v.codes
    return (isinstance(view.spec.value, AffineFormat) and view.spec.value.n_bits in (4, 8)
            and view.head_dim >= 64
            and codes.data_ptr() % 2 == 0 and all(s % 2 == 0 for s in codes.stride()[:-1]))


def swap_reason(q: torch.Tensor, view: CacheView) -> str | None:
    """None when decode_swap.py serves this call: G * L <= 4 fp16 / bf16 query rows, a
    full cache (no ring, window or sinks), head_dim 64 / 128 / 256, int8 or int4 K and V
    with one scale group per row or per half row, packed scale rows (pairs of 16-bit
    values 4-byte aligned when two groups), V code rows 2-byte aligned. Keys may also be
    int4-c64 or int4w-c64 (block metadata as `channel_keys_reason` takes it; a 32-slot
    step lies in one 64-slot block). 3-bit formats are the tile kernel's
    (`is_three_bit`)."""
    n_q, h_q, d = q.shape[2], q.shape[1], view.head_dim
    reason = three_bit_reason(view)
    if reason is not None:
        return reason
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"queries are {q.dtype}"
    if h_q // view.num_kv_heads * n_q > 4:
        return f"G * L = {h_q // view.num_kv_heads * n_q} > 4"
    if view.ring or view.window is not None or view.sinks:
        return "ring / window / sinks"
    if d not in (64, 128, 256):
        return f"head_dim {d} not in (64, 128, 256)"
    if isinstance(view.spec.key, ChannelBlockFormat):
        if view.spec.key.n_bits != 4:
            return (f"key format {view.spec.key.name} is not int8 / int4 / int4-c64 / "
                    "int4w-c64")
        reason = channel_keys_reason(view)
        if reason is not None:
            return reason
    for part, fmt, qt in (("key", view.spec.key, view.k), ("value", view.spec.value, view.v)):
        if part == "key" and isinstance(fmt, ChannelBlockFormat):
            continue
        if not isinstance(fmt, AffineFormat) or fmt.n_bits not in (4, 8):
            return f"{part} format {fmt.name} is not int8 / int4"
        if fmt.group_size < d // 2:
            return f"{part} group size {fmt.group_size} < head_dim / 2"
        ng = d // fmt.group_size
        sc, bi = qt.scales, qt.biases
        if sc.stride() != bi.stride() or sc.stride(-2) != ng:
            return f"{part} scale rows are not packed"
        if ng == 2 and (any(t.data_ptr() % 4 for t in (sc, bi))
                        or any(st % 2 for st in sc.stride()[:2])):
            return f"{part} scale pairs are not 4-byte aligned"
    if not v_pairs(view):
        return "value code rows are not 2-byte aligned"
    return None


_GLUON_SWAP: object = None


def gluon_swap_kernel():
    """decode_swap_gluon's kernel, or the reason it cannot be loaded (Gluon is Triton's
    experimental dialect: an API change must cost speed, not the import of kvtax)."""
    global _GLUON_SWAP
    if _GLUON_SWAP is None:
        try:
            from kvtax.attention.kernels.decode_swap_gluon import decode_swap_gluon_kernel
            _GLUON_SWAP = decode_swap_gluon_kernel
        except Exception as exc:  # noqa: BLE001 (any import-time failure: use the twin)
            _GLUON_SWAP = f"Gluon unavailable ({type(exc).__name__}: {exc})"
    return _GLUON_SWAP


def gluon_swap_reason(q: torch.Tensor, view: CacheView) -> str | None:
    """None when decode_swap_gluon.py serves this call (the CUDA path of kernel "swap"):
    `swap_reason`'s cases with int8 or int4 in groups of 64 for both K and V at head_dim
    128 (or int4-c64 / int4w-c64 keys beside int4 g64 values, their block metadata 16-byte
    aligned per head for its cp.async copies), packed code rows (int4w-c64's 72 bytes),
    scales in the queries' dtype,
    compiled (not interpreted) Triton with Gluon. Otherwise kernel "swap" runs
    decode_swap.py, its Triton twin."""
    if interpreting():
        return "Gluon kernels do not run in Triton's interpreter"
    if torch.version.hip is not None:
        return "the Gluon kernel is written for NVIDIA GPUs"
    if q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 0):
        return "the Gluon kernel needs sm_80+ (cp.async, mma.sync m16n8k16)"
    reason = swap_reason(q, view)
    if reason is not None:
        return reason
    k, v = view.spec.key, view.spec.value
    k_group = 64 if isinstance(k, ChannelBlockFormat) else k.group_size
    if view.head_dim != 128 or k.n_bits != v.n_bits or k_group != 64 or v.group_size != 64:
        return ("Gluon swap serves int8 / int4 K and V alike (or int4-c64 / int4w-c64 keys "
                "beside int4 values), group 64, head_dim 128")
    if isinstance(k, ChannelBlockFormat):
        meta = (view.k.scales, view.k.biases, view.k.codes)
        if any(t.data_ptr() % 16 or any(st % 16 for st in t.stride()[:2]) for t in meta):
            return f"{k.name} key storage is not 16-byte aligned per head"
    row = 128 if k.n_bits == 8 else 64
    for qt, width in ((view.k, k.code_width(128)), (view.v, row)):
        if qt.codes.shape[-1] != width or qt.codes.stride(-1) != 1 or \
                qt.codes.stride(-2) != width:
            return "code rows are not packed"
        if qt.scales.dtype != q.dtype or qt.biases.dtype != q.dtype:
            return "scales are not in the queries' dtype"
    kernel = gluon_swap_kernel()
    return kernel if isinstance(kernel, str) else None
