"""The benchmark's arms: one callable per way of computing attention over a KV cache.

Each `make_*` returns `(fn, bytes_read, note)`: `fn()` computes the attention of q
against the cache and returns `[B, H_q, L, D]`; `bytes_read` is the cache storage the
arm reads (its format's bytes), used for TB/s. Baselines are imported, not copied:
torch SDPA, the formats' own `dequantize`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtax.attention.triton_api import triton_attention
from kvtax.attention.view import CacheView
from kvtax.cache import FullCache


def kvtax_arm(q, view: CacheView, lengths, config=None):
    """Fused kernels reading the quantized cache (device lengths: the CUDA-graph mode).
    A Hadamard-rotated spec (`+hk`) rotates the query first, as `kvtax.attention` does,
    so the rotation's launch is part of the timed call."""
    from kvtax.attention.reference import rotate_query, unrotate_output

    if view.spec.rotate:
        return lambda: unrotate_output(
            triton_attention(rotate_query(q, view), view, lengths=lengths, config=config), view)
    return lambda: triton_attention(q, view, lengths=lengths, config=config)


def _sdpa_variants(q, k, v, causal_lower_right: bool):
    """Ways to ask SDPA for GQA attention with the chunk's queries at the end, in order."""
    from torch.nn.attention.bias import causal_lower_right as clr

    b, hq, n_q, d = q.shape
    hkv, ctx = k.shape[1], k.shape[2]
    g = hq // hkv
    mask = clr(n_q, ctx) if causal_lower_right and n_q > 1 else None
    yield "enable_gqa", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if n_q == 1:  # decode: fold the G heads into the query axis; no mask needed
        qf = q.reshape(b, hkv, g, d)
        yield "gqa-folded", lambda: F.scaled_dot_product_attention(qf, k, v).reshape(b, hq, 1, d)
    if mask is not None:
        dense = torch.ones(n_q, ctx, dtype=torch.bool, device=q.device).tril_(ctx - n_q)
        yield "enable_gqa+dense-mask", lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, enable_gqa=True)
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    yield "kv-repeated(4x bytes)", lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)


def sdpa_arm(q, k, v, backend, expect):
    """torch SDPA fp16 with one backend; the first variant that runs and matches wins."""
    from torch.nn.attention import sdpa_kernel

    errors = []
    for name, call in _sdpa_variants(q, k, v, causal_lower_right=True):
        def fn(call=call):
            with sdpa_kernel([backend]):
                return call()
        try:
            out = fn()
            err = _rel_err(out, expect)
            if err > 2e-2:
                errors.append(f"{name}: rel err {err:.1e}")
                continue
            return fn, name
        except Exception as exc:  # noqa: BLE001  (this backend cannot run that variant)
            errors.append(f"{name}: {str(exc).splitlines()[0][:80]}")
    raise RuntimeError("; ".join(errors))


def hf_dequant_arm(q, cache: FullCache, backend):
    """Hugging Face's QuantizedCache approach: dequantize the whole cache, then SDPA."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    view = cache.view()
    n_q, ctx = q.shape[2], view.length
    mask = causal_lower_right(n_q, ctx) if n_q > 1 else None

    def fn():
        k = view.spec.key.dequantize(view.k.slice_tokens(0, ctx), torch.float16)
        v = view.spec.value.dequantize(view.v.slice_tokens(0, ctx), torch.float16)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return fn


def unfused_arm(q, cache: FullCache):
    """mlx-lm's quantized path: scores [H, L, ctx] materialized, softmax, then P @ V.

    mlx-lm multiplies q with the packed K directly (quantized_matmul); torch has no such
    op for this layout, so K and V are dequantized first (an extra O(ctx) copy).
    """
    view = cache.view()
    b, hq, n_q, d = q.shape
    hkv, ctx = view.num_kv_heads, view.length
    g = hq // hkv
    scale = d**-0.5

    def fn():
        k = view.spec.key.dequantize(view.k.slice_tokens(0, ctx), torch.float16)
        v = view.spec.value.dequantize(view.v.slice_tokens(0, ctx), torch.float16)
        qg = (q * scale).reshape(b, hkv, g * n_q, d)  # rows (g, l)
        s = qg @ k.transpose(-1, -2)  # [B, Hkv, G*L, ctx]
        if n_q > 1:
            l_idx = torch.arange(n_q, device=q.device).repeat(g)
            pos = torch.arange(ctx, device=q.device)
            s.masked_fill_(pos[None, :] > (ctx - n_q + l_idx)[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        return (p @ v).reshape(b, hq, n_q, d)

    return fn


def unfused_bytes_estimate(q, ctx: int) -> int:
    """Transient bytes of the unfused arm: fp16 scores, probabilities, and softmax's fp32."""
    b, hq, n_q, _ = q.shape
    return b * hq * n_q * ctx * 2 * 3


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
