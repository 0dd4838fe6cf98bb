"""Checked entry point of a hybrid body's decode write for block-quantized keys
(`kernels/block_store.py`): one launch per layer where `KeyBlocks.write_at` and the value's
quantize-and-copy take ~40 small torch kernels.

    >>> from kvtax.formats import block_store_triton as bst
    >>> bst.unsupported_reason(k, v, buf, order, store.k, store.v, spec)   # None: it can run
    >>> bst.block_store(k, v, pos_t, buf, order, store.k, store.v, spec)   # pos_t [1] int64

Only for a cache whose open key block nobody reads (a hybrid body with >= 63 recent fp16
tokens, kvtax.cache.hybrid): the key's row goes into the staging ring every step, its
block (codes, scales, biases; int4w-c64: the channel order, chosen at block 0) only at the
step that fills the block, equal to what the torch path writes at that step
(tests/formats/test_block_store.py); the value's row every step. The position is read on
the device, so a CUDA graph captures it. On CPU it runs only under Triton's interpreter
(`TRITON_INTERPRET=1`, as the tests run it).
"""

from __future__ import annotations

import torch
import triton

from kvtax import pdl
from kvtax.formats.base import MODEL_DTYPES, QTensor
from kvtax.formats.channel import ChannelBlockFormat
from kvtax.formats.kernels.block_store import block_store_kernel
from kvtax.formats.mutating_op import mutating_op
from kvtax.formats.spec import KVSpec
from kvtax.formats.store_triton import (TL_DTYPES, f32_reciprocal, format_code, out_dtype,
                                        spec_named)
from kvtax.formats.widest import WidestBitFormat


def _interpreting() -> bool:
    return type(block_store_kernel).__name__ == "InterpretedFunction"


def serves(spec: KVSpec) -> bool:
    """Whether the kernel has this spec's formats: int4-c64 or int4w-c64 keys (int3-c64
    keys take the torch path), no rotation, values the store kernel writes."""
    key = spec.key
    return (isinstance(key, ChannelBlockFormat) and key.n_bits == 4 and not spec.rotate_keys
            and not spec.rotate_values and format_code(spec.value) is not None)


def unsupported_reason(
    k: torch.Tensor, v: torch.Tensor, buf: torch.Tensor, order: torch.Tensor | None,
    k_dst: QTensor, v_dst: QTensor, spec: KVSpec, *, sinks: int = 0, ring: int = 0,
) -> str | None:
    """None when `block_store` can serve this write, else why not (the caller takes the
    torch path). Arguments as for `block_store`."""
    if not (k.is_cuda or _interpreting()):
        return "tensors are not on a CUDA device (on CPU the kernel runs only interpreted)"
    if not serves(spec):
        return f"{spec.name} is not int4-c64 / int4w-c64 keys, unrotated, beside a stored value"
    fmt = spec.key
    if k.dim() != 4 or k.shape != v.shape or k.shape[2] != 1:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} must be one [B, H, 1, D] token"
    b, h, _, d = k.shape
    if k.dtype not in MODEL_DTYPES or v.dtype != k.dtype or k.stride(-1) != 1 \
            or v.stride(-1) != 1:
        return "k, v must share a model dtype, with contiguous rows"
    if d % 64 or d > 256:
        return f"head_dim {d} (the kernel takes multiples of 64 up to 256)"
    if buf.dim() != 4 or tuple(buf.shape[:2]) != (b, h) or buf.shape[3] != d \
            or buf.dtype != k.dtype or buf.stride(-1) != 1:
        return f"staging ring {tuple(buf.shape)} does not fit {(b, h, d)} in {k.dtype}"
    if buf.shape[2] < 64 or buf.shape[2] % 64:
        return f"staging ring of {buf.shape[2]} rows: a block's 64 rows must not wrap in it"
    if isinstance(fmt, WidestBitFormat) and (
            order is None or tuple(order.shape) != (b, h, d) or order.dtype != torch.int64
            or order.stride(-1) != 1):
        return "int4w-c64 keys need their channel order [B, H, D] int64"
    codes, scales, biases = k_dst
    if scales is None or biases is None or codes.shape[3] != fmt.code_width(d) \
            or codes.stride(-1) != 1 or scales.stride() != biases.stride() \
            or scales.stride(3) != 1 or scales.stride(2) != d // 64 \
            or scales.dtype != k.dtype:
        return "key storage is not int4-c64's layout with contiguous block metadata"
    if ring % 64 or sinks % 64:
        return f"sinks {sinks} and ring {ring} must be multiples of 64"
    widths = (spec.value.code_width(d), spec.value.scale_width(d), spec.value.bias_width(d))
    for name, got, width in zip(("codes", "scales", "biases"), v_dst, widths):
        if (got is None) != (width == 0):
            return f"value storage {name} do not match format {spec.value.name}"
        if got is not None and (got.shape[3] != width or got.stride(-1) != 1):
            return f"value storage {name} shape {tuple(got.shape)} does not fit"
    if v_dst.scales is not None and v_dst.biases is not None \
            and v_dst.scales.stride() != v_dst.biases.stride():
        return "value storage scales and biases have different strides"
    return None


def block_store(
    k: torch.Tensor, v: torch.Tensor, pos_t: torch.Tensor, buf: torch.Tensor,
    order: torch.Tensor | None, k_dst: QTensor, v_dst: QTensor, spec: KVSpec, *,
    sinks: int = 0, ring: int = 0,
) -> None:
    """Write token `k`, `v` `[B, H, 1, D]` at the device position `pos_t` `[1]` (int64):
    k into ring `buf` `[B, H, rows, D]` at row pos % rows and, where pos ends its 64-token
    block, that block quantized into `k_dst`; v into `v_dst`; at the slots of the cache's
    map (`sinks`, `ring`; 0: a full cache). `order` `[B, H, D]` int64: int4w-c64's channel
    order (read, and written at block 0's end); None for int4-c64. Unchecked: callers run
    `unsupported_reason` first."""
    if torch.compiler.is_compiling():
        _block_store_op(k, v, pos_t, buf, order, *k_dst, *v_dst, spec.name, sinks, ring)
        return
    _launch(k, v, pos_t, buf, order, k_dst, v_dst, spec, sinks, ring)


def _launch(k, v, pos_t, buf, order, k_dst, v_dst, spec, sinks, ring) -> None:
    b, h, _, d = k.shape
    vf = format_code(spec.value)
    assert vf is not None
    kc, ks, kb = k_dst
    vc, vs, vb = v_dst
    vc = vc.view(torch.uint8) if vc.dtype == torch.float8_e4m3fn else vc
    vs = vs if vs is not None else vc  # placeholders are never read
    vb = vb if vb is not None else vs
    v_m = vs.stride()[:3] if v_dst.scales is not None else (0, 0, 0)
    kw = isinstance(spec.key, WidestBitFormat)
    recip = k.is_cuda
    block_store_kernel[(b * h, 2)](
        pos_t, sinks, ring, buf.shape[2], h,
        k, k.stride(0), k.stride(1), buf, *buf.stride()[:3],
        order if kw else buf, *(order.stride()[:2] if kw else (0, 0)),
        kc, ks, kb, *kc.stride()[:3], *ks.stride()[:2], f32_reciprocal(15.0),
        v, v.stride(0), v.stride(1), vc, vs, vb, *vc.stride()[:3], *v_m,
        f32_reciprocal(vf[2]),
        HEAD_DIM=d, DT=TL_DTYPES[k.dtype], KW=kw, IS_RING=ring > 0, RECIP=recip,
        V_FMT=vf[0], V_GS=max(vf[1], 1), V_OUT=out_dtype(spec.value, k.dtype),
        V_NG_P=triton.next_power_of_2(d // vf[1]) if vf[1] else 1,
        D_P=triton.next_power_of_2(d), HALF_P=triton.next_power_of_2(d // 2),
        CH=min(32, triton.next_power_of_2(d)),
        num_warps=4, enable_fp_fusion=False,  # no FMA contraction: torch rounds each op
        **pdl.launch_options("store", k, _interpreting()),
    )


# torch.compile sees the write as one opaque op that mutates the ring, the order and the
# storage (kvtax.formats.mutating_op says why).
def _op_body(k, v, pos_t, buf, order, kc, ks, kb, vc, vs, vb, spec, sinks, ring) -> None:
    _launch(k, v, pos_t, buf, order, QTensor(kc, ks, kb), QTensor(vc, vs, vb),
            spec_named(spec), sinks, ring)


_block_store_op = mutating_op(
    "block_store(Tensor k, Tensor v, Tensor pos_t, Tensor(a3!) buf, Tensor(a4!)? order, "
    "Tensor(a5!) kc, Tensor(a6!) ks, Tensor(a7!) kb, Tensor(a8!) vc, Tensor(a9!)? vs, "
    "Tensor(a10!)? vb, str spec, SymInt sinks, SymInt ring) -> ()", _op_body)
