"""The default KV format works at every head_dim a loadable model has (64, 80, 96, 128, 256).

Regression: the default `int8+hk+ck` (group 64) raised FormatError on the first append at
head_dim 96 (Phi-3-mini) and 80, so the library's default did not run on every model the
loaders accept. A name without `-g<N>` now takes the largest group size up to 64 that
divides head_dim; an explicit group is still refused where it does not divide, unless it
is wider than the row (q4's sliding form names values in groups of 128).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvtax import FullCache, SlidingCache, attention, make_caches
from kvtax.errors import FormatError
from kvtax.formats import DEFAULT_KV, KVSpec, default_kv, fit_head_dim
from kvtax.models import CONFIG_NAMES, Runner, get_config, random_model

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

HEAD_DIMS = (64, 80, 96, 128, 256)
GROUP = {64: 64, 80: 16, 96: 32, 128: 64, 256: 64}  # largest of GROUP_SIZES <= 64 dividing


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_default_fits_head_dim(d: int) -> None:
    spec = KVSpec.parse(default_kv(None, d))
    assert spec.key.group_size == spec.value.group_size == GROUP[d]
    assert spec.rotate == "k" and spec.center_keys  # the recommended suffixes survive
    spec.check(d)
    capped = KVSpec.parse(default_kv(50.0, d))  # soft-capped logits: no +ck
    assert not capped.center_keys and capped.key.group_size == GROUP[d]


def test_fit_keeps_explicit_groups_and_objects() -> None:
    assert fit_head_dim("k8v4", 80).name == "k8-g16v4-g16"
    assert fit_head_dim("int4-g64", 96).name == "int4"  # explicit: left to check() to refuse
    with pytest.raises(FormatError, match="not divisible"):
        fit_head_dim("int4-g64", 96).check(96)
    obj = KVSpec.parse("int8")
    assert fit_head_dim(obj, 96) is obj
    assert fit_head_dim("fp16", 80).name == "fp16" and fit_head_dim("fp8", 96).name == "fp8"


def test_fit_says_once_what_it_picked(caplog, monkeypatch) -> None:
    from kvtax.formats import spec as spec_module

    monkeypatch.setattr(spec_module, "_fits_said", set())  # what earlier tests said
    with caplog.at_level(logging.WARNING, logger="kvtax"):
        fit_head_dim("int4+hk", 80)
        fit_head_dim("int4+hk", 80)
    said = [r.getMessage() for r in caplog.records if "int4+hk" in r.getMessage()]
    assert len(said) == 1 and "int4-g16+hk" in said[0] and "80" in said[0]


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_caches_take_the_default_at_any_head_dim(d: int) -> None:
    torch.manual_seed(d)
    k, v = torch.randn(2, 1, 2, 37, d).unbind(0)
    q = torch.randn(1, 4, 5, d)
    exact = FullCache("fp32")
    exact.append(k, v)
    ref = attention(q, exact.view())
    caches = [FullCache(DEFAULT_KV), SlidingCache(DEFAULT_KV, window=16),
              *make_caches([None], DEFAULT_KV)]
    for cache in caches:
        cache.append(k, v)
        assert cache.spec.key.group_size == GROUP[d], type(cache).__name__
    err = (attention(q, caches[0].view()) - ref).abs().max()
    assert err < 0.05, err  # int8 rounding, not a wrong answer
    if d % 64:
        with pytest.raises(FormatError, match="not divisible"):  # an explicit group is kept
            FullCache("int8-g64").append(k, v)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("short", ["q4", "q3"])
def test_short_names_run_or_name_a_spec_that_runs(short: str, d: int, caplog) -> None:
    """q4 / q3 keep keys per channel over 64-token blocks, so 64 must divide head_dim.
    Elsewhere the refusal comes before any "stored as" warning (there is no group to fit)
    and the spec it suggests runs at that head_dim."""
    import re

    model = random_model(_shrunk("tiny", d))
    prompt = torch.randint(0, 256, (1, 70))
    if d % 64 == 0:
        Runner(model, kv=short).generate(prompt, max_new_tokens=2)
        return
    with caplog.at_level(logging.WARNING, logger="kvtax"), \
            pytest.raises(FormatError, match=f"not a multiple of 64.*{short} cannot") as err:
        Runner(model, kv=short).generate(prompt, max_new_tokens=2)
    assert not [r for r in caplog.records if "stored as" in r.getMessage()]
    suggested = re.search(r"e\.g\. '([^']+)'", str(err.value))[1]
    Runner(model, kv=suggested).generate(prompt, max_new_tokens=2)


def _shrunk(name: str, d: int):
    """Built-in config `name` cut to two layers of head_dim d (its family's switches kept)."""
    cfg = get_config(name)
    types = None if cfg.layer_types is None else ("sliding_attention", "full_attention")
    return dataclasses.replace(
        cfg, vocab_size=320, hidden_size=128, intermediate_size=128, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=d, layer_types=types,
        sliding_window=8 if cfg.sliding_window else None,
        query_pre_attn_scalar=float(d), max_position_embeddings=512,
        bos_token_id=256, eos_token_id=(), name=f"{name}-d{d}")


FAMILY_CONFIGS = sorted({get_config(n).family: n for n in CONFIG_NAMES}.values())


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("name", FAMILY_CONFIGS)
def test_runner_default_runs_every_family(name: str, d: int) -> None:
    model = random_model(_shrunk(name, d))
    runner = Runner(model)
    assert runner.spec.key.group_size == GROUP[d]
    assert runner.spec.center_keys == (model.config.attn_softcap is None)
    res = runner.generate(torch.randint(0, 256, (1, 20)), max_new_tokens=3)
    assert len(res.tokens) == 3


@pytest.mark.parametrize("d", (80, 96))
def test_hf_cache_default_fits_head_dim(d: int) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from kvtax.hf import KVTaxCache, installed
    from kvtax.hf.cache import cache_kwarg
    from kvtax.hf.models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", head_dim=d)).eval()
    cache = KVTaxCache(model.config)
    assert {s.name for s in cache.specs} == {f"int8-g{GROUP[d]}+hk+ck"}
    with installed(model), torch.no_grad():
        logits = model(torch.randint(0, 97, (1, 9)), **{cache_kwarg(model): cache}).logits
    assert torch.isfinite(logits).all()


def test_quality_arms_fit_head_dim(tmp_path) -> None:
    """`kvtax quality`'s default arms (int8, int4+hk, ...) at head_dim 96 run, named by the
    group they took; hybrid and per-layer arms keep their suffixes."""
    from kvtax.formats.hybrid import fit_kv_name
    from kvtax.harness.kv_arm import parse_arm
    from kvtax.harness.quality.probe import QualityConfig, run_quality
    from kvtax.harness.recall.models import RecallModel, load_recall_model
    from kvtax.harness.store import read_rows

    assert parse_arm("int8+hk@s4r128:L0=int4").fit(96).cache == "int8-g32+hk@s4r128:L0=int4-g32"
    assert parse_arm("int4/hf-quantized").fit(80).name == "int4-g16/hf-quantized"
    assert fit_kv_name("8", 128) == "8" and fit_kv_name("native", 96) == "native"
    tiny = load_recall_model("tiny", seed=3)
    net = random_model(_shrunk("llama-3.1-8b", 96))
    model = RecallModel("d96", "kvtax", net, tiny.tokenizer, tiny.eos_ids)
    cfg = QualityConfig(model="d96", contexts=[48], kvs=["int8", "int4+hk@s2r8"], tail=8)
    rows = read_rows(run_quality(cfg, tmp_path, model=model, log=lambda s: None))
    assert [(r["kv"], r["status"]) for r in rows] == [
        ("fp16", "ok"), ("int8-g32", "ok"), ("int4-g32+hk@s2r8", "ok")]


def test_recall_arms_fit_head_dim(tmp_path) -> None:
    """`kvtax recall` at head_dim 96: its default int8 arm runs and its rows say int8-g32."""
    from kvtax.harness.recall.probe import RecallConfig, run_recall
    from kvtax.harness.recall.models import RecallModel, load_recall_model
    from kvtax.harness.store import read_rows

    tiny = load_recall_model("tiny", seed=3)
    net = random_model(_shrunk("llama-3.1-8b", 96))
    model = RecallModel("d96", "kvtax", net, tiny.tokenizer, tiny.eos_ids)
    cfg = RecallConfig(model="d96", contexts=[400], kvs=["int8"], facts=1, max_new_tokens=2)
    rows = read_rows(run_recall(cfg, tmp_path, model=model, log=lambda s: None))
    assert rows and {(r["kv"], r["status"]) for r in rows} == {("int8-g32", "ok")}


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_group_wider_than_the_row_fits(d: int) -> None:
    """q4's sliding-window form names values in groups of 128 (k4-c64v4-g128@r64i8): at
    head_dim 64 a row is one group of 64, quietly; where 128 divides head_dim it is kept;
    a narrower explicit group that does not divide is still refused."""
    want = {64: 64, 80: 16, 96: 32, 128: 128, 256: 128}[d]
    assert fit_head_dim("int4-g128", d).value.group_size == want
    cache = FullCache("int4-g128")
    k = torch.randn(1, 1, 5, d)
    cache.append(k, k.clone())
    assert cache.spec.key.group_size == want
    if d % 64:
        with pytest.raises(FormatError, match="not divisible"):
            FullCache("int4-g64").append(k, k.clone())
