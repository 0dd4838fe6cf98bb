"""What a cell measures: baselines compute the same attention, growth inside the decode
window is detected (the 256-token boundary confound measured on mlx-lm), presizing removes it, and the
quantized_kv_start conversion and path swap run through the real runner."""

from __future__ import annotations

import pytest
import torch

from kvtax.attention.reference import attention_naive
from kvtax.cache import FullCache, SlidingCache
from kvtax.attention.baselines import ATTENTION_PATHS
from kvtax.harness.bench.plan import SweepConfig, plan_cells
from kvtax.harness.schema import validate_row
from kvtax.harness.bench.worker import measure
from tests.support.tensors import assert_close, rand_kv


_CASES = {
    "full-int8-L1": (lambda kv: FullCache(kv), "int8", 1),
    "full-int4-L7": (lambda kv: FullCache(kv), "int4", 7),
    "full-fp16-L5": (lambda kv: FullCache(kv), "fp16", 5),
    "sliding-k8v4-L3": (lambda kv: SlidingCache(kv, window=40, sinks=2), "k8v4", 3),
}
_PARAMS = [
    pytest.param(path, *case, id=f"{path}-{name}")
    for name, case in _CASES.items()
    for path in ("fused", "unfused", "dequant", "fp16")
    if path != "fp16" or case[1] == "fp16"  # the fp16 path reads unquantized storage only
]


@pytest.mark.parametrize("path, make, kv, n_q", _PARAMS)
def test_baselines_match_reference(path, make, kv, n_q):
    gen = torch.Generator().manual_seed(3)
    cache = make(kv)
    cache.append(rand_kv((1, 2, 97, 64), outliers=2, gen=gen), rand_kv((1, 2, 97, 64), gen=gen))
    q = rand_kv((1, 6, n_q, 64), gen=gen)
    ref = attention_naive(q, cache.view())
    out = ATTENTION_PATHS[path](q, cache.view())
    # The fp16 path runs SDPA in fp16 (the storage dtype), hence the looser bound.
    tol = 2e-3 if path == "fp16" else 1e-5
    assert_close(out, ref, atol=tol, rel_rms=tol, what=f"{path} {kv}")


def _attn_cell(**kw) -> dict:
    cfg = SweepConfig(level="attention", model="attn-test", contexts=[kw.pop("context")],
                      kvs=["int8"], paths=["fused"], reps=1, warmup=0,
                      decode_tokens=kw.pop("decode_tokens"), heads=4, kv_heads=2, head_dim=32,
                      presize=kw.pop("presize", False))
    cell = plan_cells(cfg)[0].to_dict()
    cell.update(run_id="t", device_name="cpu", git_commit=None, **kw)
    return cell


def test_growth_inside_decode_window_is_recorded_and_presize_removes_it():
    """250 prompt tokens fill a 256-slot cache; 16 decode steps cross the boundary."""
    row = measure(_attn_cell(context=250, decode_tokens=16))
    validate_row(row)
    assert row["status"] == "ok", row
    assert row["decode_growth"] is True and row["decode_growth_events"] == 1
    far = measure(_attn_cell(context=100, decode_tokens=16))
    assert far["decode_growth"] is False
    presized = measure(_attn_cell(context=250, decode_tokens=16, presize=True))
    assert presized["presized"] is True and presized["decode_growth"] is False
    assert presized["prefill_growth_events"] == 0


def _model_cell(path: str, kv: str, **kw) -> dict:
    cfg = SweepConfig(contexts=[kw.pop("context", 48)], kvs=[kv], paths=[path], reps=1,
                      warmup=0, decode_tokens=3, quantized_kv_start=kw.pop("q_start", 0),
                      chunk_size=kw.pop("chunk_size", 2048))
    (cell,) = [c for c in plan_cells(cfg) if c.path == path]
    d = cell.to_dict()
    d.update(run_id="t", device_name="cpu", git_commit=None, **kw)
    return d


def test_quantized_kv_start_converts_mid_prompt():
    row = measure(_model_cell("fused", "int8", context=48, q_start=20, chunk_size=16))
    validate_row(row)
    assert row["status"] == "ok", row
    assert row["quantized_kv_start"] == 20
    plain = measure(_model_cell("fused", "int8", context=48, chunk_size=16))
    # Same quantized cache once converted: the resident bytes do not depend on the delay.
    assert row["cache_used_bytes"] == plain["cache_used_bytes"]


def test_path_swap_reaches_the_decoder(monkeypatch):
    """The unfused cell really calls the unfused function (not kvtax attention)."""
    from kvtax.attention import baselines as bl

    calls = []
    orig = bl.attention_unfused

    def spy(*a, **k):
        calls.append(a[0].shape)
        return orig(*a, **k)

    monkeypatch.setitem(bl.ATTENTION_PATHS, "unfused", spy)
    row = measure(_model_cell("unfused", "int8", context=16))
    assert row["status"] == "ok", row
    assert calls, "the decoder never called the swapped attention"
    import kvtax.models.decoder as dec
    from kvtax.attention import attention

    assert dec.attention is attention  # restored afterwards


@pytest.mark.parametrize("phases", [["prefill"], ["decode"]], ids=["prefill-only", "decode-only"])
def test_single_phase_cells(phases):
    cell = _attn_cell(context=64, decode_tokens=4)
    cell["phases"] = phases
    row = measure(cell)
    validate_row(row)
    assert row["status"] == "ok", row
    assert (row["ttft_s"] is not None) == ("prefill" in phases)
    assert (row["decode_ms_per_token"] is not None) == ("decode" in phases)
    assert row["cache_bytes"] > 0  # the prompt is always run, measured or not


@pytest.mark.parametrize("path, kv, want", [
    ("fp16", "fp16", "math"), ("dequant", "int8", "math"), ("unfused", "int8", None),
    ("fused", "int8", None)])
def test_model_rows_say_how_decode_ran(path, kv, want):
    """Each row says whether decode replayed a graph (not on CPU) and which SDPA backend
    the baselines' calls took; extra.sdpa_backend pins it."""
    row = measure(_model_cell(path, kv, context=24, extra={"sdpa_backend": "math"}))
    assert row["status"] == "ok", row
    assert row["cuda_graph"] is False and row["graph_off_reason"] is None
    assert row["sdpa_backend"] == want
