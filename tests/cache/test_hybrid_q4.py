"""q4 hybrid caches (int4-c64 keys, int4-g32 values, 4 fp16 sinks, 128 fp16 recent): attention
equals attention_naive over each query's concatenation "fp16 sinks | body | fp16 recent",
whatever the chunking, for full and sliding layers."""

from __future__ import annotations

import pytest
import torch

from kvtax.attention import CacheView, attention
from kvtax.attention.reference import attention_naive
from kvtax.cache import make_caches
from kvtax.cache.hybrid import HybridCache
from kvtax.formats import ChannelBlockFormat, KVSpec, QTensor
from kvtax.formats.hybrid import parse_kv
from tests.support.tensors import assert_close, rand_kv

FP32 = KVSpec.parse("fp32")


def _blocks(k: torch.Tensor, fmt: ChannelBlockFormat) -> torch.Tensor:
    """Keys `[B, H, n, D]` block-quantized the direct way and decoded (last block padded
    with its last token)."""
    pad = -k.shape[2] % 64
    x = torch.cat([k, k[:, :, -1:].expand(-1, -1, pad, -1)], dim=2) if pad else k
    return fmt.dequantize(fmt.quantize(x))[:, :, :k.shape[2]]


def _expected(q, k, v, name: str, window: int | None) -> torch.Tensor:
    """attention_naive of each query over its own key set: keys a hybrid layer reads in
    fp16 (sinks, the `recent` nearest) at fp16, the rest as the body stores them."""
    spec = parse_kv(name)
    n, n_q = k.shape[2], q.shape[2]
    sinks = spec.sinks if window is None else 0
    recent = spec.recent if window is None else min(spec.recent, window)
    kq, vf = _blocks(k, spec.base.key), spec.base.value
    vq = vf.dequantize(vf.quantize(v))
    k16, v16 = k.half().float(), v.half().float()
    outs = []
    for i in range(n_q):
        p = n - n_q + i
        kpos = torch.arange(p + 1)
        exempt = ((kpos < sinks) | (p - kpos < recent))[None, None, :, None]
        kk = torch.where(exempt, k16[:, :, :p + 1], kq[:, :, :p + 1]).contiguous()
        vv = torch.where(exempt, v16[:, :, :p + 1], vq[:, :, :p + 1]).contiguous()
        view = CacheView(QTensor(kk), QTensor(vv), FP32, k.shape[-1], p + 1, window=window,
                         dtype=torch.float32)
        outs.append(attention_naive(q[:, :, i:i + 1], view))
    return torch.cat(outs, dim=2)


CASES = [
    pytest.param(None, 64, 3, [300], id="full-D64-G3-one"),
    pytest.param(None, 128, 4, [7, 100, 1, 130, 64, 1], id="full-D128-G4-odd"),
    pytest.param(None, 256, 1, [130, 130, 7], id="full-D256-MHA"),
    pytest.param(None, 64, 2, [1] * 200, id="full-D64-decode"),
    pytest.param(200, 64, 2, [130, 64, 100, 7, 1, 130], id="window200-D64-odd"),
    pytest.param(512, 128, 4, [100, 130, 130, 130, 100, 7, 1], id="window512-D128"),
]


@pytest.mark.parametrize("window,d,group,chunks", CASES)
def test_q4_hybrid_matches_per_query_concatenation(window, d, group, chunks) -> None:
    _check_hybrid("q4", window, d, group, chunks)


@pytest.mark.parametrize("window,d,group,chunks", [CASES[1], CASES[2], CASES[4]])
def test_widest_bit_keys_hybrid_matches_per_query_concatenation(window, d, group, chunks):
    """int4w-c64 keys (the tile kernels on CUDA, the torch reference on CPU) in the same
    hybrid layout as q4's."""
    _check_hybrid("k4w-c64v4@s4r128", window, d, group, chunks)


def _check_hybrid(name: str, window, d, group, chunks) -> None:
    assert isinstance(parse_kv(name).base.key, ChannelBlockFormat)
    n = sum(chunks)
    gen = torch.Generator().manual_seed(n + d)
    k = rand_kv((1, 2, n, d), outliers=3, gen=gen)
    v = rand_kv((1, 2, n, d), gen=gen)
    q = rand_kv((1, 2 * group, n, d), gen=gen)
    cache = HybridCache(name, window=window)
    start = 0
    for t in chunks:  # each chunk's queries right after its K/V, the last 40 checked
        cache.append(k[:, :, start:start + t], v[:, :, start:start + t])
        start += t
        if start < n - 40 and t == 1:
            continue  # decoding: the final check below covers these steps' storage
        lo = max(start - t, start - 40)
        got = attention(q[:, :, lo:start], cache.view())
        want = _expected(q[:, :, lo:start], k[:, :, :start], v[:, :, :start], name, window)
        assert_close(got, want, atol=2e-5, rel_rms=2e-6, what=f"after {start} tokens")
    assert cache.length == n and cache.body is not None


def test_make_caches_gives_q4_layers_block_aligned_bodies() -> None:
    caches = make_caches([None, 512], "q4")
    assert caches[0].spec.name == "k4w-c64v4@s4r128" and caches[0].sinks == 4
    assert caches[1].sinks == 0 and caches[1].body.ring % 64 == 0


def test_q4_sliding_layers_keep_their_recent_tokens_in_int8():
    """q4 on a sliding-window layer: int4-c64 keys need >= 63 recent tokens outside the
    body, an eighth of a 512 window in fp16, so the short name keeps 64 in int8 there, with
    values in groups of 128 (k4-c64v4-g128@r64i8, SLIDING_FORMS); its expansion gets the
    same, an explicit --sliding-kv wins, and other specs are unchanged."""
    from kvtax.cache.policy import make_caches
    from kvtax.formats.hybrid import sliding_form

    for spec in ("q4", "k4w-c64v4@s4r128"):
        names = [c.spec.name for c in make_caches([512, None, 512], spec)]
        assert names == ["k4-c64v4-g128@r64i8", "k4w-c64v4@s4r128", "k4-c64v4-g128@r64i8"]
    assert [c.spec.name for c in make_caches([512, None], "q4", sliding_spec="fp16")] == [
        "fp16", "k4w-c64v4@s4r128"]
    assert sliding_form("q8") is None and sliding_form("int4+hk@s4r128") is None
    for spec in ("q3", "k3-c64v3-g32@s4r96"):  # q3: per-token int3 keys and 16 recent
        assert [c.spec.name for c in make_caches([512, None], spec)] == [
            "int3+hk@s4r16", "k3-c64v3-g32@s4r96"]
    at64 = make_caches([512], "q4")[0]  # head_dim 64: the body fits one group per row
    at64.append(*torch.randn(2, 1, 1, 70, 64).unbind(0))
    assert at64.spec.name == "k4-c64v4@r64i8" and at64.body.spec.value.group_size == 64
    cache = make_caches([512], "q4")[0]
    k, v = torch.randn(2, 1, 2, 600, 256, dtype=torch.bfloat16).unbind(0)
    cache.append(k, v)
    assert cache.spec.name == "k4-c64v4-g128@r64i8"  # 128 divides head_dim 256: kept
    # per KV head (2): 512 window rows of int4-c64 keys (128 B of codes + a bf16 scale and
    # bias per channel per 64 tokens: 16 B a row) and int4 values (128 B + 2 groups of 128
    # with a scale and bias), and 64 recent tokens in int8 (256 B + 4 groups: 272 B per K
    # or V)
    assert cache.used_nbytes == 2 * (512 * (128 + 16 + 128 + 2 * 4) + 64 * 2 * 272)
