"""`model.generate` with a KVTaxCache equals transformers' own DynamicCache, family by family.

Tiny random models (kvtax.hf.models.tiny_config) of Llama, Qwen2, Qwen3, Mistral, Gemma 2 and
Gemma 3, batch 2 with the second row left-padded, a 19-token prompt against a sliding window
of 8 and sliding layers attending in chunks of 5: every path (GQA, causal, windows, chunked
append, padding, soft-capping, custom scale) runs. The baseline always runs on a model the
adapter was never installed on.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvtax.hf import KVTaxCache, installed
from kvtax.hf.cache import cache_kwarg
from kvtax.hf.models import FAMILIES, tiny_config
from tests.support.tensors import assert_close, errors

REQUIRED = ("llama", "qwen3", "gemma3")
PROMPT, NEW = 19, 6


def _model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family)).eval().to(dtype)


def _inputs(seed: int = 0, batch: int = 2, prompt: int = PROMPT):
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(1, 97, (batch, prompt), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :4] = 0  # row 1 is left-padded by 4
        ids[1, :4] = 0
    return ids, mask


def _generate(model, ids, mask, cache=None, **kw):
    args = dict(
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    args.update(kw)
    if cache is not None:
        args[cache_kwarg(model)] = cache
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(ids, **args)
    return out.sequences, torch.stack(out.scores, 1)  # [B, P+N], [B, N, vocab]


def _kvtax(model, ids, mask, kv, **cache_kw):
    gen_kw = cache_kw.pop("gen", {})
    cache = KVTaxCache(
        model.config, kv=kv, prefill_chunk=cache_kw.pop("prefill_chunk", 5), **cache_kw
    )
    with installed(model):
        seq, scores = _generate(model, ids, mask, cache, **gen_kw)
    return seq, scores, cache


def _teacher_forced_logits(model, seq, mask):
    """Baseline logits `[B, N, vocab]` for predicting each generated token of `seq`."""
    full = torch.cat([mask, torch.ones(mask.shape[0], NEW, dtype=mask.dtype)], 1)
    with torch.no_grad():
        logits = model(seq, attention_mask=full[:, : seq.shape[1]]).logits
    return logits[:, PROMPT - 1 : PROMPT - 1 + NEW]


def assert_greedy_matches(seq, scores, model, mask, what: str) -> None:
    """Greedy tokens equal the baseline's argmax, except at ties the logit error explains.

    Teacher-forced on the quantized run's own tokens, so one near-tie flip cannot make
    every later step differ. A flip counts only where the baseline's own preference for
    its top token over ours is within twice the logit error measured at that step.
    """
    ref = _teacher_forced_logits(model, seq, mask).float()
    got_tok = seq[:, PROMPT:]
    ref_top = ref.argmax(-1)
    err = (scores.float() - ref).abs().amax(-1)  # [B, N]
    regret = ref.max(-1).values - ref.gather(-1, got_tok[..., None])[..., 0]
    bad = (got_tok != ref_top) & (regret > 2 * err)
    assert not bad.any(), f"{what}: greedy tokens differ beyond ties at {bad.nonzero().tolist()}"


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_storage_equals_dynamic_cache(family: str) -> None:
    """Lossless storage: tokens identical and logits equal to float rounding."""
    model = _model(family)
    ids, mask = _inputs()
    ref_seq, ref_scores = _generate(model, ids, mask)
    seq, scores, _ = _kvtax(model, ids, mask, "fp32")
    assert torch.equal(seq, ref_seq), family
    assert_close(scores, ref_scores, atol=2e-5, rel_rms=1e-5, what=family)


@pytest.mark.parametrize("family", REQUIRED)
def test_fp16_storage_matches_dynamic_cache_fp16_model(family: str) -> None:
    """An fp16 model with the fp16 format stores K/V exactly; only attention arithmetic
    differs (kvtax accumulates in fp32, SDPA in fp16), hence the fp16-level tolerance."""
    model = _model(family, dtype=torch.float16)
    ids, mask = _inputs()
    ref_seq, ref_scores = _generate(model, ids, mask)
    seq, scores, _ = _kvtax(model, ids, mask, "fp16")
    assert torch.equal(seq, ref_seq), family
    assert_close(scores.float(), ref_scores.float(), atol=3e-3, rel_rms=3e-3, what=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_greedy_tokens_match(family: str) -> None:
    model = _model(family)
    ids, mask = _inputs()
    seq, scores, _ = _kvtax(model, ids, mask, "int8")
    assert_greedy_matches(seq, scores, model, mask, family)
    # int8 rounding of K/V moves tiny-model logits by a fraction of a percent.
    ref = _teacher_forced_logits(model, seq, mask)
    assert errors(scores, ref)[1] < 2e-2, family


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral"])
def test_static_preallocated_storage(family: str) -> None:
    """`max_cache_len`: compileable, storage allocated once, never moved, same output."""
    model = _model(family)
    ids, mask = _inputs()
    ref_seq, ref_scores = _generate(model, ids, mask)
    cache = KVTaxCache(model.config, kv="fp32", max_cache_len=PROMPT + NEW, prefill_chunk=5)
    assert cache.is_compileable
    want = [PROMPT + NEW if w is None else w for w in cache.windows]
    assert [cache.get_max_length(i) for i in range(len(want))] == want
    with installed(model), torch.no_grad():
        model(ids[:, -1:], **{cache_kwarg(model): cache})  # allocates the storage
        ptrs = [layer.cache.store.k.codes.data_ptr() for layer in cache.layers]
        cache.reset()
        seq, scores = _generate(model, ids, mask, cache)
    assert [layer.cache.store.k.codes.data_ptr() for layer in cache.layers] == ptrs
    assert all(layer.cache.growth_events == 0 for layer in cache.layers)
    assert torch.equal(seq, ref_seq)
    assert_close(scores, ref_scores, atol=2e-5, rel_rms=1e-5, what=family)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_transformers_chunked_prefill(family: str) -> None:
    """generate(prefill_chunk_size=7): transformers feeds the prompt in chunks."""
    model = _model(family)
    ids, mask = _inputs()
    ref_seq, ref_scores = _generate(model, ids, mask)
    seq, scores, _ = _kvtax(model, ids, mask, "fp32", gen={"prefill_chunk_size": 7})
    assert torch.equal(seq, ref_seq)
    assert_close(scores, ref_scores, atol=2e-5, rel_rms=1e-5, what=family)


def test_beam_search_reorders_cache() -> None:
    model = _model("llama")
    ids, mask = _inputs()
    ref_seq, _ = _generate(model, ids, mask, num_beams=3)
    seq, _, _ = _kvtax(model, ids, mask, "fp32", gen={"num_beams": 3})
    assert torch.equal(seq, ref_seq)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_crop_then_refeed_matches(family: str) -> None:
    """crop(-3) forgets the newest 3 tokens; feeding them again gives the same logits."""
    model = _model(family, seed=3)
    ids, _ = _inputs(batch=1, prompt=7)  # short enough that no sliding ring has wrapped
    cache = KVTaxCache(model.config, kv="fp32")
    key = cache_kwarg(model)
    with installed(model), torch.no_grad():
        full = model(ids, **{key: cache}).logits
        assert cache.is_croppable
        cache.crop(-3)
        assert cache.get_seq_length() == 4
        again = model(ids[:, 4:], **{key: cache}).logits
    assert_close(again, full[:, 4:], atol=1e-5, rel_rms=1e-5, what=family)
