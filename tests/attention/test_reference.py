"""Reference attention: blockwise ≡ naive ≡ torch SDPA, over odd shapes; the memory bound."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from kvtax.attention import attention, attention_blockwise
from kvtax.attention.reference import attention_naive
from kvtax.cache import FullCache, SlidingCache
from kvtax.errors import ShapeError
from tests.support.tensors import assert_close, rand_kv

# (context, head_dim, gqa, format): every context, head dim, GQA ratio and format appears.
CASES = [
    (1, 64, 1, "fp16"),
    (1, 256, 8, "int4"),
    (63, 80, 4, "int8-g16"),
    (63, 96, 8, "fp8"),
    (257, 128, 1, "int4-g32"),
    (257, 64, 4, "k8v4"),
    (257, 256, 4, "int8-g128"),
    (1000, 96, 1, "int8-g32"),
    (1000, 128, 8, "fp8"),
    (1000, 80, 4, "int4-g16"),
    (8193, 64, 8, "int4"),
    (8193, 128, 4, "int8"),
]


def _ids(c):
    ctx, d, g, fmt = c
    return f"L{ctx}-D{d}-G{g}-{fmt}"


def _filled(spec: str, ctx: int, d: int, hkv: int = 2, batch: int = 1, **kw):
    cache = SlidingCache(spec, **kw) if "window" in kw else FullCache(spec)
    k = rand_kv((batch, hkv, ctx, d), outliers=2)
    v = rand_kv((batch, hkv, ctx, d))
    for s in range(0, ctx, 700):  # chunked prefill, as a runner would
        cache.append(k[:, :, s : s + 700], v[:, :, s : s + 700])
    return cache


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("n_q", [1, 7], ids=["decode", "chunk7"])
def test_blockwise_matches_naive(case, n_q) -> None:
    ctx, d, gqa, fmt = case
    n_q = min(n_q, ctx)
    cache = _filled(fmt, ctx, d)
    q = rand_kv((1, 2 * gqa, n_q, d))
    view = cache.view()
    want = attention_naive(q, view)
    got = attention_blockwise(q, view, block=96)  # odd tile size: partial tiles everywhere
    assert_close(got, want, atol=2e-5, rel_rms=1e-5, what=_ids(case))


def _sdpa_oracle(q, cache, *, window=None, sinks=0, scale=None):
    """float64 torch SDPA over the dequantized cache with an explicit boolean mask."""
    view = cache.view()
    order = view.logical_order()
    k = view.spec.key.dequantize(view.k.index_tokens(order)).double()
    v = view.spec.value.dequantize(view.v.index_tokens(order)).double()
    kp = view.slot_positions()[order]
    qp = torch.arange(view.length - q.shape[2], view.length)
    mask = kp[None, :] <= qp[:, None]
    if window is not None:
        mask &= (qp[:, None] - kp[None, :] < window) | (kp[None, :] < sinks)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
def test_reference_matches_torch_sdpa(fmt: str) -> None:
    cache = _filled(fmt, 300, 64, batch=2)
    q = rand_kv((2, 8, 33, 64))
    want = _sdpa_oracle(q, cache, scale=0.3)
    # float32 arithmetic against a float64 oracle over 300 keys: ~1e-5 absolute.
    for fn in (attention_naive, attention_blockwise):
        assert_close(fn(q, cache.view(), scale=0.3), want, atol=5e-5, rel_rms=5e-6, what=fn.__name__)


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_sliding_window_with_sinks_matches_sdpa(fmt: str) -> None:
    cache = _filled(fmt, 500, 64, window=64, sinks=4)
    q = rand_kv((1, 4, 40, 64))
    want = _sdpa_oracle(q, cache, window=64, sinks=4)
    assert_close(attention_blockwise(q, cache.view(), block=50), want, atol=5e-5, rel_rms=5e-6)


def test_softcap_changes_scores_as_gemma2() -> None:
    cache = _filled("int8", 200, 64)
    q = rand_kv((1, 4, 5, 64)) * 4  # large logits, so capping matters
    view = cache.view()
    capped = attention_blockwise(q, view, softcap=5.0, block=64)
    assert_close(capped, attention_naive(q, view, softcap=5.0), atol=2e-5, rel_rms=1e-5)
    # Independent check of the formula on the dequantized cache.
    order = view.logical_order()
    k = view.spec.key.dequantize(view.k.index_tokens(order)).repeat_interleave(2, 1)
    v = view.spec.value.dequantize(view.v.index_tokens(order)).repeat_interleave(2, 1)
    s = q @ k.transpose(-1, -2) / 8.0
    s = 5.0 * torch.tanh(s / 5.0)
    s = s.masked_fill(torch.ones(5, 200, dtype=torch.bool).tril(195).logical_not(), -math.inf)
    assert_close(capped, torch.softmax(s, -1) @ v, atol=2e-5, rel_rms=1e-5)
    assert (capped - attention_blockwise(q, view)).abs().max() > 1e-2


def test_decode_row_equals_last_prefill_row_and_chunking_is_invariant() -> None:
    k, v = rand_kv((1, 2, 120, 64)), rand_kv((1, 2, 120, 64))
    q = rand_kv((1, 8, 120, 64))
    whole = FullCache("int4")
    whole.append(k, v)
    full_out = attention_blockwise(q, whole.view())
    chunked, outs = FullCache("int4"), []
    for s, e in [(0, 50), (50, 51), (51, 119), (119, 120)]:
        chunked.append(k[:, :, s:e], v[:, :, s:e])
        outs.append(attention_blockwise(q[:, :, s:e], chunked.view(), block=32))
    assert_close(torch.cat(outs, 2), full_out, atol=1e-5, rel_rms=1e-6, what="chunked")


def test_batch_and_non_contiguous_queries() -> None:
    cache = _filled("int8", 130, 64, batch=3)
    q = rand_kv((3, 6, 64, 8)).transpose(2, 3)  # [3, 6, 8, 64], non-contiguous
    assert not q.is_contiguous()
    got = attention_blockwise(q, cache.view(), block=40)
    assert_close(got, attention_naive(q.contiguous(), cache.view()), atol=2e-5, rel_rms=1e-5)
    # Each batch row is independent of the others.
    solo = FullCache("int8")
    view = cache.view()
    solo.append(
        view.spec.key.dequantize(view.k.slice_tokens(0, 130))[1:2],
        view.spec.value.dequantize(view.v.slice_tokens(0, 130))[1:2],
    )
    assert_close(got[1:2], attention_naive(q[1:2], solo.view()), atol=2e-2, rel_rms=2e-2,
                 what="requantized row (a second round trip moves values by < a step)")


def test_output_dtype_and_dispatch_on_cpu() -> None:
    cache = _filled("int4", 64, 64)
    q = rand_kv((1, 4, 3, 64), dtype=torch.bfloat16)
    cache_bf = FullCache("int4")
    cache_bf.append(torch.randn(1, 2, 64, 64).bfloat16(), torch.randn(1, 2, 64, 64).bfloat16())
    out = attention(q, cache_bf.view())
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    with pytest.raises(RuntimeError, match="Triton attention cannot run"):
        attention(q.float(), cache.view(), impl="triton")


def test_bad_queries_are_rejected() -> None:
    view = _filled("int8", 10, 64).view()
    with pytest.raises(ShapeError, match="head_dim"):
        attention_blockwise(torch.randn(1, 4, 1, 32), view)
    with pytest.raises(ShapeError, match="evenly"):
        attention_blockwise(torch.randn(1, 3, 1, 64), view)
    with pytest.raises(ShapeError, match="batch"):
        attention_blockwise(torch.randn(2, 4, 1, 64), view)
    with pytest.raises(ShapeError, match="only 10 positions"):
        attention_blockwise(torch.randn(1, 4, 11, 64), view)
    with pytest.raises(ShapeError, match=r"\[batch, q_heads"):
        attention_blockwise(torch.randn(4, 1, 64), view)


def _peak_rss_delta(fn) -> int:
    """Bytes the peak RSS rose above the RSS at the start of `fn` (Linux)."""

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = status("VmRSS:")
    fn()
    return status("VmHWM:") - base


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.access("/proc/self/clear_refs", os.W_OK),
    reason="peak-RSS reset needs Linux /proc/self/clear_refs",
)
def test_blockwise_memory_is_bounded_where_naive_is_not() -> None:
    """At 32k context × 512 queries the score matrix alone is 512 MiB; blockwise stays small."""
    ctx, n_q, hq = 32768, 512, 8
    cache = FullCache("int4")
    cache.append(torch.randn(1, 2, ctx, 64), torch.randn(1, 2, ctx, 64))
    q = torch.randn(1, hq, n_q, 64)
    scores_bytes = hq * n_q * ctx * 4
    blockwise = _peak_rss_delta(lambda: attention_blockwise(q, cache.view(), block=256))
    naive = _peak_rss_delta(lambda: attention_naive(q, cache.view()))
    assert naive >= scores_bytes, f"naive peak {naive / 2**20:.0f} MiB"
    assert blockwise * 10 <= naive, (
        f"blockwise peak {blockwise / 2**20:.1f} MiB vs naive {naive / 2**20:.1f} MiB"
    )


def test_production_code_never_imports_the_oracle() -> None:
    """kvtax.attention.reference is the tests' oracle: a kernel or path that imported its
    helpers would be checked against itself. Every module under src/kvtax (but the
    oracle) is parsed for imports of it; the blockwise CPU path lives in blockwise.py."""
    import ast
    from pathlib import Path

    import kvtax

    root = Path(kvtax.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "reference.py" and path.parent.name == "attention":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module else [])
            if any(n.startswith("kvtax.attention.reference") for n in names):
                offenders.append(str(path.relative_to(root)))
    assert offenders == []
