"""Centered keys (`+ck`): exact under softmax, and they remove per-channel key offsets.

A model that adds a constant vector to every key (Qwen2.5's k_proj bias) makes that
offset set each token's quantization range; subtracting one fixed per-(sequence, head)
vector moves all of a query's scores by the same amount, which softmax cancels.
"""

from __future__ import annotations

import pytest
import torch

from kvtax.attention import attention, attention_blockwise
from kvtax.attention.reference import attention_naive
from kvtax.cache import FullCache, SlidingCache
from kvtax.cache.hybrid import HybridCache
from kvtax.errors import FormatError
from kvtax.formats import KVSpec
from tests.support.tensors import assert_close, errors, rand_kv


def _offset_keys(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian keys plus a large constant offset in a few channels (per head)."""
    gen = torch.Generator().manual_seed(seed)
    k = rand_kv(shape, gen=gen)
    offset = torch.zeros(shape[1], shape[-1])
    offset[:, :4] = 25.0 * torch.randn(shape[1], 4, generator=gen)
    return k + offset[None, :, None, :]


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over unquantized (fp32) K/V: what every format is compared with."""
    c = FullCache("fp32")
    c.append(k, v)
    return attention_blockwise(q, c.view())


def test_spec_names_round_trip() -> None:
    for text, name in [("int8+ck", "int8+ck"), ("int8+ck+hk", "int8+hk+ck"),
                       ("k8v4+hkv+ck", "k8v4+hkv+ck"), ("int4-g32+hk+ck", "int4-g32+hk+ck")]:
        spec = KVSpec.parse(text)
        assert spec.name == name and spec.center_keys and KVSpec.parse(name) == spec
    assert not KVSpec.parse("int8+hk").center_keys
    for bad in ("int8+ck+ck", "int8+hk+hkv", "int8+cv"):
        with pytest.raises(FormatError, match="suffixes are"):
            KVSpec.parse(bad)
    with pytest.raises(FormatError, match="hybrid spec"):
        KVSpec.parse("int4+hk+ck@s4r128")


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_centering_leaves_attention_unchanged_without_quantization(kind: str) -> None:
    k, v = _offset_keys((1, 2, 90, 64), seed=0), rand_kv((1, 2, 90, 64))
    q = rand_kv((1, 4, 7, 64))

    def make(spec: str):
        return FullCache(spec) if kind == "full" else SlidingCache(spec, window=40, sinks=2)

    plain, centered = make("fp32"), make("fp32+hk+ck")
    for c in (plain, centered):
        for s in range(0, 90, 30):  # chunked: the shift is fixed by the first chunk
            c.append(k[:, :, s : s + 30], v[:, :, s : s + 30])
    assert centered.key_shift is not None and centered.key_shift.abs().max() > 5
    want = attention_naive(q, plain.view())
    for fn in (attention_naive, attention_blockwise):
        assert_close(fn(q, centered.view()), want, atol=1e-4, rel_rms=1e-5, what=fn.__name__)


@pytest.mark.parametrize("base", ["int8", "int4", "int8+hk", "int4-g32+hk"])
def test_centering_cuts_error_of_offset_keys(base: str) -> None:
    k, v = _offset_keys((1, 2, 256, 128), seed=1), rand_kv((1, 2, 256, 128))
    q = rand_kv((1, 8, 16, 128))
    ref = _exact(q, k, v)
    rel = {}
    for spec in (base, f"{base}+ck"):
        c = FullCache(spec)
        c.append(k, v)
        rel[spec] = errors(attention_blockwise(q, c.view()), ref)[1]
    assert rel[f"{base}+ck"] < 0.5 * rel[base], rel


def test_shift_is_the_first_chunk_mean_and_kept_in_place() -> None:
    k, v = _offset_keys((2, 3, 50, 64), seed=2), rand_kv((2, 3, 50, 64))
    c = FullCache("int8+ck")
    c.append(k[:, :, :0], v[:, :, :0])  # an empty first update (the HF adapter's) sets nothing
    c.append(k[:, :, :20], v[:, :, :20])
    shift = c.key_shift
    assert shift is not None and shift.shape == (2, 3, 1, 64)
    torch.testing.assert_close(shift, k[:, :, :20].mean(2, keepdim=True))
    c.append(k[:, :, 20:], v[:, :, 20:])
    torch.testing.assert_close(c.key_shift, k[:, :, :20].mean(2, keepdim=True))
    c.reset()  # a new prompt: a new mean, in the same tensor (a captured graph reads it)
    c.append(k[:, :, 30:], v[:, :, 30:])
    assert c.key_shift is shift
    torch.testing.assert_close(shift, k[:, :, 30:].mean(2, keepdim=True))


def test_write_at_stores_what_append_stores() -> None:
    k, v = _offset_keys((1, 2, 33, 64), seed=3), rand_kv((1, 2, 33, 64))
    a, b = FullCache("int4+ck", capacity=40), FullCache("int4+ck", capacity=40)
    for c in (a, b):
        c.append(k[:, :, :32], v[:, :, :32])
    a.append(k[:, :, 32:], v[:, :, 32:])
    b.write_at(k[:, :, 32:], v[:, :, 32:], torch.tensor([32]))
    b.advance(1)
    for x, y in zip(a.view().k.parts() + a.view().v.parts(),
                    b.view().k.parts() + b.view().v.parts()):
        assert torch.equal(x[:, :, :33], y[:, :, :33])


def test_hybrid_parts_share_one_shift() -> None:
    """fp16 sinks/recent and the quantized body meet in one softmax: one shift for both."""
    k, v = _offset_keys((1, 2, 200, 64), seed=4), rand_kv((1, 2, 200, 64))
    q = rand_kv((1, 4, 1, 64))
    ref = _exact(q, k, v)
    rel = {}
    for spec in ("int4@s4r16", "int4+ck@s4r16"):
        c = HybridCache(spec)
        c.append(k[:, :, :120], v[:, :, :120])
        c.append(k[:, :, 120:], v[:, :, 120:])
        rel[spec] = errors(attention(q, c.view()), ref)[1]
        if "ck" in spec:
            assert c.key_shift is not None
            assert all(p.key_shift is None and not p.center_keys for p in c.parts)
    assert rel["int4+ck@s4r16"] < 0.5 * rel["int4@s4r16"], rel


def test_soft_capping_refuses_centered_keys() -> None:
    k, v, q = rand_kv((1, 1, 8, 64)), rand_kv((1, 1, 8, 64)), rand_kv((1, 2, 1, 64))
    c = FullCache("int8+ck")
    c.append(k, v)
    with pytest.raises(FormatError, match="soft-capping"):
        attention(q, c.view(), softcap=30.0)
    h = HybridCache("int8+ck@s2r4")
    h.append(k, v)
    with pytest.raises(FormatError, match="soft-capping"):
        attention(q, h.view(), softcap=30.0)
    attention(q, c.view())  # no cap: fine


def test_default_kv_centers_keys_unless_logits_are_capped() -> None:
    import dataclasses

    from kvtax.errors import OptionError
    from kvtax.formats import DEFAULT_KV, default_kv
    from kvtax.models import load_model
    from kvtax.models.runner import Runner

    assert KVSpec.parse(DEFAULT_KV).center_keys and default_kv(None) == DEFAULT_KV
    assert not KVSpec.parse(default_kv(50.0)).center_keys
    model = load_model("tiny")
    assert Runner(model).spec.name == DEFAULT_KV
    model.config = dataclasses.replace(model.config, attn_softcap=50.0)
    assert Runner(model).spec.name == "int8+hk"  # the default adapts
    with pytest.raises(OptionError, match="soft-capping"):
        Runner(model, kv="int4+ck")
    with pytest.raises(OptionError, match="soft-capping"):
        Runner(model, kv="int8", overrides={0: "int8+hk+ck"})
