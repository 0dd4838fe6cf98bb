"""The sweep's time budget: CellClock's setup + per-token estimate, and cells that alone
would outlast the whole budget written as "skipped" rows with the reason."""

from __future__ import annotations

import pytest

from kvtax.harness.bench import sweep
from kvtax.harness.bench.plan import Cell, SweepConfig
from kvtax.harness.store import read_rows
from kvtax.harness.bench.sweep import CellClock, run_sweep


def _cell(arm: str, ctx: int, warmup: bool = False) -> Cell:
    kv, path = arm.split("/")
    return Cell(cell_id=f"{arm}|{ctx}", seq=0, order_seed=0, rep=0, warmup=warmup,
                kind="bench", model="m", level="model", kv=kv, path=path, context=ctx,
                chunk_size=2048, decode_tokens=16, phases=["prefill", "decode"], presize=True,
                quantized_kv_start=0, device="cpu", dtype="float32", seed=0, batch=1,
                threads=None, cuda_graph=None, heads=4, kv_heads=2, head_dim=64)


def test_a_warm_up_is_not_scaled_to_the_largest_context():
    """H200 sweep, 2026-12-01: a 15 s first warm-up at 4k, scaled x32 to 128k, refused
    every later cell of the default budget."""
    clock = CellClock()
    clock.add(_cell("fp16/fused", 4096, warmup=True), 15.0)
    assert clock.estimate(_cell("fp16/fused", 131072)) == 0.0, "unknown: run it"
    assert clock.estimate(_cell("int8/fused", 4096, warmup=True)) == 15.0


def test_setup_plus_per_token_from_the_same_arm():
    clock = CellClock()
    clock.add(_cell("fp16/fused", 4096), 5.0)
    clock.add(_cell("fp16/fused", 16384), 8.0)
    clock.add(_cell("int8/fused", 4096), 4.0)
    per_token = 3.0 / (16384 - 4096)
    assert clock.estimate(_cell("fp16/fused", 131072)) == pytest.approx(
        8.0 + per_token * (131072 - 16384))
    assert clock.estimate(_cell("fp16/fused", 8192)) == pytest.approx(5.0 + per_token * 4096)
    # One context of the arm: the cheapest cell seen is its setup, the rest scales.
    assert clock.estimate(_cell("int8/fused", 16384)) == pytest.approx(4.0)
    clock.add(_cell("int4/fused", 4096), 6.0)
    assert clock.estimate(_cell("int4/fused", 16384)) == pytest.approx(4.0 + 2.0 * 4)
    # Nothing of this arm: the slowest arm at this context, else unknown.
    assert clock.estimate(_cell("fp8/fused", 4096)) == 6.0
    assert clock.estimate(_cell("fp8/fused", 65536)) == 0.0


def test_above_the_largest_context_the_cost_grows_as_fast_as_measured():
    """The unfused arm's prefill is quadratic in context (H200, 2026-12-01: 5.4 s at 16k,
    12.5 s at 32k): a line through them guesses 26.7 s at 64k; the power they show, more."""
    clock = CellClock()
    clock.add(_cell("fp16/fused", 4096), 2.0)        # the setup: the cheapest cell seen
    clock.add(_cell("int8/unfused", 16384), 2.0 + 4.0)
    clock.add(_cell("int8/unfused", 32768), 2.0 + 16.0)
    assert clock.estimate(_cell("int8/unfused", 65536)) == pytest.approx(2.0 + 64.0)
    assert clock.estimate(_cell("int8/unfused", 131072)) == pytest.approx(2.0 + 256.0)
    # Between measured contexts it stays the line; the power is capped at 2.
    assert clock.estimate(_cell("int8/unfused", 24576)) == pytest.approx(12.0)
    clock.add(_cell("int4/unfused", 16384), 2.0 + 1.0)
    clock.add(_cell("int4/unfused", 32768), 2.0 + 10.0)
    assert clock.estimate(_cell("int4/unfused", 65536)) == pytest.approx(2.0 + 40.0)


def test_a_cell_longer_than_the_whole_budget_is_a_skipped_row(tmp_path, monkeypatch):
    cfg = SweepConfig(level="attention", model="attn-test", heads=4, kv_heads=2, head_dim=64,
                      contexts=[16, 32], kvs=["fp16"], paths=["fused"], reps=1, warmup=0,
                      decode_tokens=2)
    real = CellClock.estimate
    monkeypatch.setattr(sweep.CellClock, "estimate",
                        lambda self, c: 1e6 if c.context == 32 else real(self, c))
    store = run_sweep(cfg, out=str(tmp_path), print_fn=lambda s: None, budget_s=600.0)
    by_ctx = {r["context"]: r for r in read_rows(store.path)}
    assert by_ctx[16]["status"] == "ok"
    assert by_ctx[32]["status"] == "skipped"
    assert "more than the whole time budget of 600 s" in by_ctx[32]["error"]


def test_no_arm_is_measured_before_its_warm_up(tmp_path, monkeypatch):
    """A warm-up left for --resume holds back its arm's measured cells too."""
    cfg = SweepConfig(level="attention", model="attn-test", heads=4, kv_heads=2, head_dim=64,
                      contexts=[16], kvs=["fp16", "int8"], paths=["fused"], reps=1, warmup=1,
                      decode_tokens=2)
    real = CellClock.estimate
    monkeypatch.setattr(sweep.CellClock, "estimate", lambda self, c: 600.0 if c.warmup and
                        c.kv == "int8" else real(self, c))
    store = run_sweep(cfg, out=str(tmp_path), print_fn=lambda s: None, budget_s=600.0)
    assert sorted(r["arm"] for r in read_rows(store.path)) == ["fp16/fused", "fp16/fused"]
    store = run_sweep(cfg, resume=str(store.path), print_fn=lambda s: None)
    int8 = sorted((r for r in read_rows(store.path) if r["kv"] == "int8"),
                  key=lambda r: r["seq"])
    assert [r["warmup"] for r in int8] == [True, False]


def test_max_context_0_leaves_an_arm_out_with_its_reason():
    """`--max-context fp8/unfused=0`: every cell of that arm is a skipped row saying so (the
    H200 sweep leaves out the fp8 baselines: the stacks they stand for have no fp8 cache)."""
    from kvtax.cli.bench import _limits
    from kvtax.harness.bench.sweep import skip_reason

    limits = _limits("fp8/unfused=0,dequant=32k")
    assert limits == {"fp8/unfused": 0, "dequant": 32768}
    cfg = SweepConfig(max_context=limits)
    out = skip_reason(_cell("fp8/unfused", 4096), cfg, {})
    assert out and "left out of this sweep" in out
    assert skip_reason(_cell("int8/unfused", 131072), cfg, {}) is None
    assert "above max_context 32768" in skip_reason(_cell("int8/dequant", 65536), cfg, {})
    assert skip_reason(_cell("int8/dequant", 32768), cfg, {}) is None
