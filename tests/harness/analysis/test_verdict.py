"""The verdict against the best fp16 arm, on planted GPU-like rows (quantized KV pays off at
long context) and CPU-like rows (stock SDPA 3.9x faster per context token than kvtax's
own path; quantized slope ratios 0.98 / 0.82 where bytes predict 1.78 / 3.20)."""

from __future__ import annotations

import pytest

from kvtax.cli import main as cli_main
from kvtax.harness.analysis import stats
from kvtax.harness.analysis.analyze import summarize
from kvtax.harness.report.write import write_report
from kvtax.harness.report.verdict import section_verdict, sentences
from kvtax.harness.store import RunStore
from kvtax.harness.analysis.verdict import advice_grid, finish_s, verdict
from tests.support.rows import CPU, CPU_CTX, GPU, GPU_CTX, H200, WEIGHTS, planted_rows


def test_best_baseline_is_the_fastest_unquantized_arm_not_kvtax_by_fiat():
    cpu = summarize(planted_rows(CPU, CPU_CTX))
    assert cpu["baseline"] == "fp16/fp16"
    assert set(cpu["baseline_candidates"]) == {"fp16/fused", "fp16/fp16"}
    gpu = summarize(planted_rows(GPU, GPU_CTX))
    assert gpu["baseline"] == "fp16/fused"
    # Other engines' arms count by their format: llama.cpp's f16 beats both here.
    fast = dict(GPU, **{"f16/fa": (3.0, 2.0e-5, 1.0e-4, 131072)})
    assert summarize(planted_rows(fast, GPU_CTX))["baseline"] == "f16/fa"
    assert stats.is_unquantized("bf16/fused") and not stats.is_unquantized("q8_0/fa")


def test_cpu_comparisons_are_against_stock_sdpa():
    a = summarize(planted_rows(CPU, CPU_CTX))
    assert a["slope_ratios"]["int8/fused"]["measured"] == pytest.approx(0.98, abs=0.01)
    assert a["slope_ratios"]["int4/fused"]["measured"] == pytest.approx(0.82, abs=0.01)
    assert a["slope_ratios"]["int4/fused"]["predicted"] == pytest.approx(3.2)
    # int8/dequant decodes faster than kvtax's fp16 but not than stock: never pays back.
    assert set(a["break_even"]["int8/dequant"].values()) == {"never"}


def test_cpu_verdict_says_quantized_kv_does_not_pay_off():
    a = summarize(planted_rows(CPU, CPU_CTX, model="tiny", weights=10_000_000))
    env = {"device": "AMD EPYC", "device_type": "cpu", "mem_total_bytes": 8 * 2**30}
    v = verdict(a, env, weight_bytes=10_000_000, model="tiny")
    assert not v["pays_off"] and v["quantized_wins"] == []
    say = sentences(v)
    assert say[0].startswith("On AMD EPYC with tiny, quantized KV does not pay off for speed")
    assert "fp16/fp16" in say[0]
    assert all(r["faster_from"] is None for r in v["formats"])
    assert {cell["winner"] for per in v["advice"].values() for cell in per.values()} == \
        {"fp16/fp16"}
    assert "CPU MemTotal" in v["memory_source"]
    int4 = next(r for r in v["formats"] if r["arm"] == "int4/fused")
    assert int4["tokens_fit"] == (8 * 2**30 - 10_000_000) // 640
    assert int4["tokens_fit_ratio"] == pytest.approx(3.2, rel=1e-4)


def test_gpu_verdict_where_quantized_pays_off():
    a = summarize(planted_rows(GPU, GPU_CTX))
    v = verdict(a, H200, weight_bytes=WEIGHTS, model="llama-3.1-8b")
    assert v["pays_off"]
    rows = {r["arm"]: r for r in v["formats"]}
    assert set(rows) == {"int8/fused", "int4/fused"}
    # fp16 4.49 ms vs int8 4.46 ms at 16k: faster from there (slower at 4k: higher t0).
    assert rows["int8/fused"]["faster_from"] == 16384
    assert rows["int8/fused"]["decode_speedup"] == pytest.approx(7.932 / 6.297, rel=1e-3)
    assert rows["int4/fused"]["prefill_penalty"] == pytest.approx(1.34, rel=1e-3)
    # Break-even at 128k: 0.2 x 13.1 s of prefill paid back by 1.635 ms per token.
    assert rows["int8/fused"]["break_even"] == pytest.approx(0.2 * 13.1072 / 1.6384e-3, rel=0.02)
    assert rows["int8/fused"]["tokens_fit"] == (150_000_000_000 - WEIGHTS) // 69632
    grid = v["advice"]
    assert grid[131072][64]["winner"] == "fp16/fused", "short answer: keep fp16"
    assert grid[4096][4096]["winner"] == "fp16/fused", "short context: keep fp16"
    assert grid[131072][4096]["winner"] in ("int8/fused", "int4/fused")
    lead = sentences(v)[0]
    assert lead.startswith("On NVIDIA H200 with llama-3.1-8b, quantized KV pays off for speed")
    md = "\n".join(section_verdict(v))
    assert "| int8/fused | 16,384 |" in md
    assert "- **64 generated tokens** (a short answer): keep fp16 KV at every context" in md


def test_finish_time_and_memory_fit():
    a = summarize(planted_rows(GPU, GPU_CTX))
    t = finish_s(a, "int8/fused", 65536, 512)
    fit = a["fits"]["int8/fused"]
    ttft = a["ttft_points"]["int8/fused"][65536]["median"]
    assert t == pytest.approx(ttft + 512 * (fit["t0"] + fit["m"] * (65536 + 256)) / 1000)
    # A device that holds the fp16 cache at 64k but not at 128k.
    grid = advice_grid(a, memory=WEIGHTS + 100_000 * 131072, weights=WEIGHTS)
    assert "fp16/fused" in grid[131072][64]["misfit"]
    assert "int4/fused" not in grid[131072][64]["misfit"]
    assert grid[65536][64]["misfit"] == []
    assert grid[131072][64]["winner"] not in grid[131072][64]["misfit"]


def test_report_opens_with_the_verdict(tmp_path):
    store = RunStore.create(tmp_path, "cpu", {"command": "kvtax bench", "cv_threshold": 0.1})
    store.write_env({"device": "AMD EPYC", "device_type": "cpu", "hostname": "elsewhere",
                     "timestamp": "2026-12-01T21:00:00+00:00"})
    for r in planted_rows(CPU, CPU_CTX, model="tiny", weights=10_000_000):
        r["memory_kind"] = "cpu_rss"
        store.append(r)
    md = write_report(store.path).read_text()
    body = md[md.index("## Verdict"):]
    assert md.index("## Verdict") < md.index("## Decode")
    assert body.splitlines()[2].startswith("**On AMD EPYC with tiny, quantized KV does not pay")
    assert "Capacity is not computed" in body, "another host's memory is not guessed"
    assert "process's peak resident set size" in md and "cache held" in md
    assert "seed 00" not in md.lower()


def test_a_win_on_prefill_alone_is_not_the_cache_paying_off():
    """A quantized arm with a faster prefill but slower decode may answer 64 tokens first;
    the verdict still says quantized KV does not pay off (its cache is not why)."""
    arms = dict(CPU, **{"int8/dequant": (10.2, 2.0e-3, 1.0e-4, 1152)})
    a = summarize(planted_rows(arms, CPU_CTX, model="tiny"))
    v = verdict(a, {"device": "cpu"}, weight_bytes=None, model="tiny")
    assert v["advice"][1024][64]["winner"] == "int8/dequant"
    assert not v["pays_off"]
    assert "does not pay off" in sentences(v)[0]


def test_linked_quality_and_recall_runs_fill_the_verdict(tmp_path):
    bench = RunStore.create(tmp_path, "gpu", {"cv_threshold": 0.1})
    bench.write_env(H200)
    for r in planted_rows(GPU, GPU_CTX):
        bench.append(r)
    qrun = RunStore.create(tmp_path, "q", {"kind": "quality"})
    for i, (kv, ctx, kl) in enumerate([("int8", 4096, 0.002), ("int8", 32768, 0.004),
                                       ("int4", 32768, 0.05)]):
        qrun.append({"kind": "quality", "status": "ok", "cell_id": f"q{i}", "kv": kv,
                     "context": ctx, "kl": kl, "seq": i, "model": "llama-3.1-8b"})
    rrun = RunStore.create(tmp_path, "r", {"kind": "recall"})
    for i in range(4):
        rrun.append({"kind": "recall", "status": "ok", "cell_id": f"r{i}", "arm": "int4/fused",
                     "context": 4096, "correct": i < 3, "fact_index": i, "warmup": False})
    assert cli_main(["report", str(bench.path), "--quality", str(qrun.path),
                     "--recall", str(rrun.path)]) == 0
    md = (bench.path / "report.md").read_text()
    int8 = next(ln for ln in md.splitlines() if ln.startswith("| int8/fused | 16,384 |"))
    assert "0.00400 @ 32,768" in int8, "KL at the largest context with a quality row"
    int4 = next(ln for ln in md.splitlines() if ln.startswith("| int4/fused |"))
    assert "0.0500 @ 32,768" in int4 and int4.rstrip(" |").endswith("3/4")
    assert cli_main(["report", str(bench.path), "--quality", str(tmp_path / "nope")]) == 2


def test_a_run_without_quantized_arms_says_so():
    a = summarize(planted_rows({"fp16/fused": GPU["fp16/fused"]}, GPU_CTX))
    lead = sentences(verdict(a, H200, weight_bytes=None, model="m"))[0]
    assert "no quantized format was measured" in lead and "does not pay off" not in lead
