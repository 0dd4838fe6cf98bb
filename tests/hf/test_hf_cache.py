"""KVTaxCache units: layer kinds, exact resident bytes, per-layer formats, masks, refusals."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvtax.attention import attention_blockwise
from kvtax.attention.reference import attention_naive
from kvtax.cache import FullCache
from kvtax.errors import FormatError, ShapeError
from kvtax.formats import KVSpec
from kvtax.hf import KVTaxCache, installed, layer_windows
from kvtax.hf.attention import kvtax_mask
from kvtax.hf.cache import cache_kwarg
from kvtax.hf.models import FAMILIES, tiny_config
from tests.support.tensors import assert_close, rand_kv


def _model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family)).eval()


def _run(model, cache, ids, mask=None):
    with installed(model), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model(ids, attention_mask=mask, **{cache_kwarg(model): cache}).logits


def test_layer_kinds_follow_the_config() -> None:
    want = {
        "llama": [None, None],
        "qwen2": [None, None],
        "qwen3": [None, None],
        "mistral": [8, 8],
        "gemma2": [8, None],
        "gemma3": [8, 8, None],
    }
    assert {f: layer_windows(tiny_config(f)) for f in FAMILIES} == want
    cache = KVTaxCache(tiny_config("gemma3"), kv="int4")
    assert cache.is_sliding == [True, True, False]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        layer_windows(LlamaConfig(num_hidden_layers=2, attention_chunk_size=16))


@pytest.mark.parametrize("kv", ["int4", "k8v4", "fp8"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_resident_bytes_equal_format_arithmetic(family: str, kv: str) -> None:
    """used_nbytes = bytes_per_token × tokens held × KV heads × batch, summed over layers;
    a sliding layer counts at most its window (its ring's window - 1 + prefill_chunk slots
    are allocated, nbytes; the older rows a chunk leaves there no query reads)."""
    model = _model(family)
    cfg = model.config
    batch, tokens, chunk = 2, 23, 5
    cache = KVTaxCache(cfg, kv=kv, prefill_chunk=chunk)
    _run(model, cache, torch.randint(1, 97, (batch, tokens)))
    per = KVSpec.parse(kv).bytes_per_token(cfg.head_dim, torch.float32)
    held = [tokens if w is None else min(tokens, w) for w in layer_windows(cfg)]
    want = sum(per * h * cfg.num_key_value_heads * batch for h in held)
    assert cache.used_nbytes == want
    assert cache.get_seq_length() == tokens


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_static_allocation_equals_format_arithmetic(family: str) -> None:
    """Preallocated: every full layer holds max_cache_len slots, every ring window-1+chunk,
    each allocated rounded up to storage.ALIGN slots (aligned scale strides)."""
    from kvtax.cache.storage import ALIGN, round_up

    model = _model(family)
    cfg = model.config
    max_len, chunk = 40, 6
    cache = KVTaxCache(cfg, kv="int8", max_cache_len=max_len, prefill_chunk=chunk)
    _run(model, cache, torch.randint(1, 97, (1, 17)))
    per = KVSpec.parse("int8").bytes_per_token(cfg.head_dim, torch.float32)
    slots = [round_up(max_len if w is None else w - 1 + chunk, ALIGN) for w in layer_windows(cfg)]
    assert cache.nbytes == sum(per * s * cfg.num_key_value_heads for s in slots)


def test_per_layer_formats() -> None:
    cfg = tiny_config("gemma3")
    cache = KVTaxCache(cfg, kv="int4", sliding_kv="fp16", overrides={2: "k8v4"})
    assert [s.name for s in cache.specs] == ["fp16", "fp16", "k8v4"]
    cache = KVTaxCache(cfg, kv="int4")
    assert [s.name for s in cache.specs] == ["int4"] * 3


def test_unfit_format_fails_at_construction() -> None:
    """head_dim 48 does not split into groups of 32: an explicit -g32 fails before any
    forward; a name without a group, or with one wider than the row, takes one that
    divides head_dim (fit_head_dim)."""
    with pytest.raises(FormatError, match="int8-g16"):
        KVTaxCache(tiny_config("llama", head_dim=48), kv="int8-g32")
    assert KVTaxCache(tiny_config("llama", head_dim=48), kv="int8-g64").specs[0].name == "int8-g16"
    assert KVTaxCache(tiny_config("llama", head_dim=48), kv="int8").specs[0].name == "int8-g16"
    assert KVTaxCache(tiny_config("llama", head_dim=48), kv="int8-g16").specs[0].name == "int8-g16"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_hybrid_short_context_reads_fp16(family: str) -> None:
    """q4 keeps 4 sink and 128 recent tokens in fp16 (a sliding layer 64 in int8,
    k4-c64v4-g128@r64i8): under that many tokens its logits are those of fp16 KV (int8 on the
    sliding layers)."""
    model = _model(family, seed=2)
    ids = torch.randint(1, 97, (1, 40))
    cache = KVTaxCache(model.config, kv="q4")
    assert not any(layer.is_compileable for layer in cache.layers)
    want = KVTaxCache(model.config, kv="fp16", sliding_kv="int8")
    assert_close(_run(model, cache, ids), _run(model, want, ids),
                 atol=1e-4, rel_rms=1e-5, what=family)
    specs = {s.name for s in cache.specs}
    assert specs == ({"k4w-c64v4@s4r128"} if family == "llama"
                     else {"k4w-c64v4@s4r128", "k4-c64v4-g128@r64i8"}), specs


def test_hybrid_chunked_prefill_and_decode_equal_one_shot() -> None:
    """Past the fp16 tokens (300 > 4 + 128) q4 reads its int4 body: a prefill in uneven
    chunks and then one-token steps give one 300-token forward's logits."""
    model = _model("llama", seed=3)
    ids = torch.randint(1, 97, (1, 300))
    whole = _run(model, KVTaxCache(model.config, kv="q4"), ids)
    cache = KVTaxCache(model.config, kv="q4")
    parts, s = [], 0
    for n in (130, 64, 101, 1, 1, 1, 1, 1):
        parts.append(_run(model, cache, ids[:, s : s + n]))
        s += n
    assert_close(torch.cat(parts, 1), whole, atol=1e-4, rel_rms=1e-5, what="q4 chunked")
    fp16 = KVTaxCache(model.config, kv="fp16")
    _run(model, fp16, ids)
    # what HybridCache counts: 132 fp16 tokens and a float32 model's int4 body, under fp16's
    assert cache.used_nbytes == sum(layer.cache.used_nbytes for layer in cache.layers)
    assert cache.used_nbytes < 0.8 * fp16.used_nbytes
    cache.crop(250)
    assert cache.get_seq_length() == 250


def test_hybrid_generate_and_refusals() -> None:
    model = _model("gemma3", seed=4)
    ids = torch.randint(1, 97, (1, 150))
    with installed(model), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        cache = KVTaxCache(model.config, kv="q3")
        out = model.generate(ids, max_new_tokens=6, do_sample=False,
                             **{cache_kwarg(model): cache})
        assert out.shape == (1, 156) and cache.get_seq_length() == 155
        padded = KVTaxCache(model.config, kv="q4")
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[0, :3] = 0
        with pytest.raises(ShapeError, match="left-padded"):
            model(torch.randint(1, 97, (2, 20)), attention_mask=mask,
                  **{cache_kwarg(model): padded})


def test_chunked_forward_equals_one_shot() -> None:
    """Prefill by hand in uneven chunks (3, 9, 1, 6) equals one 19-token forward."""
    model = _model("gemma3", seed=5)
    ids = torch.randint(1, 97, (1, 19))
    whole = _run(model, KVTaxCache(model.config, kv="fp32", prefill_chunk=4), ids)
    cache = KVTaxCache(model.config, kv="fp32", prefill_chunk=4)
    parts, s = [], 0
    for n in (3, 9, 1, 6):
        parts.append(_run(model, cache, ids[:, s : s + n]))
        s += n
    assert_close(torch.cat(parts, 1), whole, atol=1e-5, rel_rms=1e-5, what="chunked")


def test_cache_without_install_says_how_to_fix() -> None:
    model = _model("llama")
    cache = KVTaxCache(model.config, kv="int8")
    with pytest.raises(AttributeError, match="kvtax.hf.install"):
        with torch.no_grad():
            model(torch.randint(1, 97, (1, 5)), **{cache_kwarg(model): cache})


def test_installed_model_refuses_plain_tensors() -> None:
    model = _model("llama")
    with installed(model), torch.no_grad(), pytest.raises(TypeError, match="KVTaxCache"):
        model(torch.randint(1, 97, (1, 5)), use_cache=False)


def test_right_padding_is_refused() -> None:
    model = _model("llama")
    ids = torch.randint(1, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with pytest.raises(NotImplementedError, match="left padding"):
        _run(model, KVTaxCache(model.config, kv="int8"), ids, mask)


def test_mask_function_refuses_other_patterns() -> None:
    """A chunked-attention mask and a custom overlay are refused, causal/sliding pass."""
    causal = lambda b, h, q, k: k <= q  # noqa: E731
    chunked = lambda b, h, q, k: (k <= q) & (k // 4 == q // 4)  # noqa: E731
    assert kvtax_mask(1, 6, 6, 0, 0, mask_function=causal) is None
    with pytest.raises(NotImplementedError, match="sliding-window"):
        kvtax_mask(1, 6, 6, 0, 0, mask_function=chunked, local_size=4)
    with pytest.raises(NotImplementedError, match="custom mask"):
        kvtax_mask(1, 6, 6, 0, 0, mask_function=causal, use_vmap=True)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    valid = kvtax_mask(2, 6, 6, 0, 0, mask_function=causal, attention_mask=mask)
    assert valid.shape == (2, 1, 1, 6) and torch.equal(valid[:, 0, 0], mask.bool())


@pytest.mark.parametrize("spec", ["fp32", "int4"])
def test_kv_start_reference_equals_unpadded_rows(spec: str) -> None:
    """Foundation extension: `kv_start` hides each row's left padding. Row b of a padded
    batch must equal attention over that row alone, with the padding never stored."""
    b, hkv, hq, d, n, q_len = 3, 2, 6, 64, 37, 5
    pad = torch.tensor([0, 7, 20])
    k = rand_kv((b, hkv, n, d), outliers=2)
    v = rand_kv((b, hkv, n, d))
    q = rand_kv((b, hq, q_len, d))
    cache = FullCache(spec)
    cache.append(k, v)
    got = attention_blockwise(q, cache.view(), kv_start=pad, block=16)
    naive = attention_naive(q, cache.view(), kv_start=pad)
    assert_close(got, naive, atol=2e-5, rel_rms=1e-5, what="blockwise vs naive")
    for row in range(b):
        alone = FullCache(spec)
        s = int(pad[row])
        alone.append(k[row : row + 1, :, s:], v[row : row + 1, :, s:])
        want = attention_naive(q[row : row + 1], alone.view())
        assert_close(got[row : row + 1], want, atol=2e-5, rel_rms=1e-5, what=f"row {row}")
