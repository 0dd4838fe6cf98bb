"""Capacity arithmetic (vLLM's 13.37 GiB reservation on an L4) and claim verdicts."""

from __future__ import annotations

import pytest
import torch

from kvtax.harness.analysis import capacity as cap
from kvtax.harness.analysis.claims import evaluate
from kvtax.models import get_config


def test_parse_size_units():
    assert cap.parse_size("13.37GiB") == int(13.37 * 2**30)
    assert cap.parse_size("16GB") == 16 * 10**9
    assert cap.parse_size("512 MiB") == 512 * 2**20
    assert cap.parse_size("1e9B") == 10**9
    assert cap.parse_size("0") == 0
    for unitless in ("13.37", "1e9", "4096"):  # "13.37" was once 13 bytes, 0 tokens
        with pytest.raises(ValueError, match="give a unit"):
            cap.parse_size(unitless)
    with pytest.raises(ValueError):
        cap.parse_size("lots")


def test_llama31_8b_capacity_at_vllms_l4_reservation():
    """fp16 Llama-3.1-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 B = 131,072 B/token.
    vLLM reported 109,504 tokens at 13.37 GiB (block-rounded); the bytes give 109,527."""
    cfg = get_config("llama-3.1-8b")
    budget = cap.parse_size("13.37GiB")
    fp16 = cap.kv_layout(cfg, "fp16")
    assert fp16.per_token == 131072
    assert cap.tokens_fitting(budget, fp16) == budget // 131072 == 109527
    fp8 = cap.tokens_fitting(budget, cap.kv_layout(cfg, "fp8"))
    # fp8 stores one bf16 scale per token and head: 130 B instead of 128 per K row.
    assert fp8 == budget // (32 * 8 * 2 * (128 + 2))
    assert 1.9 < fp8 / 109527 < 2.0
    int4 = cap.tokens_fitting(budget, cap.kv_layout(cfg, "int4"))
    assert int4 == budget // (32 * 8 * 2 * (64 + 2 * 2 * 2))  # codes + bf16 scale/bias x 2 groups
    # vLLM's fp8 (one scale per tensor): 219,008 there (16-token blocks), 128 B per K row here
    assert cap.tokens_fitting(budget, cap.kv_layout(cfg, "fp8-pt")) == budget // 65536 == 219054


@pytest.mark.parametrize("kv, parts", [("fp16", (131072, 0, 0)), ("fp8", (65536, 1024, 0)),
                                       ("fp8-pt", (65536, 0, 0)), ("int4", (32768, 2048, 2048)),
                                       ("k8v4", (49152, 2048, 2048))])
def test_token_parts_split_bytes_per_token(kv, parts):
    """Llama-3.1-8B, bf16: codes / scales / biases bytes per token over 32 layers x 8 heads."""
    cfg = get_config("llama-3.1-8b")
    assert cap.token_parts(cfg, kv) == parts
    assert sum(parts) == cap.kv_layout(cfg, kv).per_token


def test_sliding_layers_capped_at_window():
    cfg = get_config("gemma-3-4b")
    lay = cap.kv_layout(cfg, "fp16")
    windows = cfg.layer_windows()
    n_full = sum(w is None for w in windows)
    per_layer = 4 * 256 * 2 * 2
    assert lay.full == n_full * per_layer
    assert len(lay.sliding) == len(windows) - n_full
    ctx = 100_000
    assert lay.bytes_at(ctx) == n_full * per_layer * ctx + len(lay.sliding) * per_layer * 1024
    fit = cap.tokens_fitting(lay.bytes_at(ctx), lay)
    assert fit == ctx
    assert cap.tokens_fitting(lay.bytes_at(ctx) - 1, lay) == ctx - 1


def test_longest_context_subtracts_weights_and_overhead():
    lay = cap.KVLayout(full=1000)
    assert cap.longest_context(10_000_000, 4_000_000, lay, overhead_bytes=1_000_000) == 5000
    assert cap.longest_context(1_000, 4_000_000, lay) == 0
    assert cap.tokens_fitting(10**6, cap.KVLayout(0, ((512, 10),))) == cap.UNBOUNDED


def _analysis(**kw):
    base = {
        "baseline": "fp16/fused",
        "slope_ratios": {"int8/fused": {"measured": 1.92, "predicted": 1.88}},
        "fits": {"int8/fused": {"r2": 0.995}},
        "peaks": {
            "prefill": {"fp16/fused": {1024: 100, 2048: 200}, "int4/fused": {1024: 90, 2048: 260}},
            "decode": {"fp16/fused": {1024: 100}, "int4/fused": {1024: 60}},
        },
        "prefill_penalty": {"int4/fused": {2048: {"ratio": 2.2}}},
        "break_even": {"int4/fused": {1024: "never", 2048: 4166}},
        "decode_points": {},
    }
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "claim, verdict",
    [
        ({"metric": "slope_ratio", "arm": "int8", "range": [1.8, 2.1]}, "held"),
        ({"metric": "slope_ratio", "arm": "int8", "range": [1.95, 2.1]}, "failed"),
        ({"metric": "slope_ratio", "arm": "int4", "range": [3.5, 4.5]}, "not measurable"),
        ({"metric": "r2", "arm": "int8/fused", "min": 0.98}, "held"),
        ({"metric": "prefill_peak_le_fp16", "arm": "int4"}, "failed"),
        ({"metric": "decode_peak_le_fp16", "arm": "int4"}, "held"),
        ({"metric": "decode_peak_le_fp16", "arm": "int8"}, "not measurable"),
        ({"metric": "prefill_penalty", "arm": "int4", "context": 2048, "range": [1.5, 2.5]},
         "held"),
        ({"metric": "break_even", "arm": "int4", "context": 2048, "range": [0, 5000]}, "held"),
        ({"metric": "break_even", "arm": "int4", "context": 1024, "range": [0, 5000]}, "failed"),
        ({"metric": "no_such_metric", "arm": "int4"}, "not measurable"),
    ],
)
def test_claim_verdicts(claim, verdict):
    out = evaluate(claim, _analysis())
    assert out["verdict"] == verdict, out
    assert out["claim"] and out["why"]


def test_failed_peak_claim_names_the_context():
    out = evaluate({"metric": "prefill_peak_le_fp16", "arm": "int4"}, _analysis())
    assert "2048" in out["why"]
    assert out["numbers"][2048] == {"arm": 260, "fp16": 200}


def test_model_bytes_per_token_matches_capacity_layout():
    from kvtax.formats import KVSpec
    from kvtax.harness.bench.cells import model_bytes_per_token

    cfg = get_config("llama-3.1-8b")
    spec = KVSpec.parse("int8")
    assert model_bytes_per_token(cfg, spec, torch.bfloat16) == cap.kv_layout(cfg, spec).per_token


@pytest.mark.parametrize("kv", ["q4", "q3", "int4+hk@s4r32", "q8", "fp16"])
@pytest.mark.parametrize("context", [3, 40, 128, 300])
def test_hybrid_layout_is_what_the_caches_hold(kv, context):
    """`kvtax capacity --kv q4`: the body grows with the context, the fp16 sinks / recent
    window (and q4's int8 recent part on sliding layers) stay fixed. The layout's bytes
    are what make_caches' caches report as used after `context` tokens, on a model with
    sliding (window 64) and full layers, in bf16: q4's sliding form is all int8 recent
    tokens there, q3's a body beside 16 recent ones. Plain sliding caches once counted
    the ring slots a long prefill chunk left as used (2,559 of a 512-token window after a
    2,048-token chunk), so a bench on Gemma-3 overstated fp16's bytes beside q4's."""
    from kvtax.cache import make_caches

    cfg = get_config("tiny-gemma3")
    torch.manual_seed(context)
    caches = make_caches(cfg.layer_windows(), kv)
    k, v = torch.randn(2, 1, cfg.num_kv_heads, context, cfg.head_dim,
                       dtype=torch.bfloat16).unbind(0)
    for c in caches:  # one chunk: a ring widened for it holds working space, not used
        c.append(k, v)
    assert cap.kv_layout(cfg, kv).bytes_at(context) == sum(c.used_nbytes for c in caches)


def test_hybrid_capacity_leaves_the_fixed_parts_out_of_bytes_per_token():
    cfg = get_config("llama-3.1-8b")
    q4, int4 = cap.kv_layout(cfg, "q4"), cap.kv_layout(cfg, "int4")
    # int4w-c64 keys weigh int4's plus D/16 bytes a row (fifth bits and channel order)
    assert int4.per_token == 36864 and q4.per_token == 36864 + 32 * 8 * 128 // 16
    assert q4.fixed_bytes == 32 * 8 * 132 * 2 * 128 * 2  # 4 sinks + 128 recent, fp16 K and V
    k4 = cap.kv_layout(cfg, "k4-c64v4@s4r128")  # int4-c64 keys weigh what int4's do
    assert k4.per_token == 36864 and cap.token_parts(cfg, "k4-c64v4@s4r128") == \
        cap.token_parts(cfg, "int4")
    budget = cap.parse_size("13.37GiB")
    assert cap.tokens_fitting(budget, q4) == (budget - q4.fixed_bytes) // q4.per_token
