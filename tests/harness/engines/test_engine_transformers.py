"""The transformers engine on a tiny random stock model (the `tiny` config's shapes): arms,
unavailable arms, caches cross-checked through their logits, bytes, quanto's
re-quantizations, transformers' compiled decode step, and `kvtax bench --engine
transformers` end to end (rows, resume, errors and unavailable arms as rows, missing
package)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.support.engine_hidden import hidden_env  # noqa: E402
from kvtax.errors import KVTaxError  # noqa: E402
from kvtax.harness.engines import EngineSpec, EngineUnavailable, get_engine  # noqa: E402
from kvtax.harness.engines.transformers_engine import (  # noqa: E402
    KvArm, TransformersEngine, arm_unavailable, parse_kv,
)
from kvtax.harness.store import read_rows  # noqa: E402
from kvtax.models import get_config  # noqa: E402

CFG = get_config("tiny")  # 4 layers, 2 KV heads, head_dim 64; float32 weights here
HAS_QUANTO = importlib.util.find_spec("optimum") is not None and \
    importlib.util.find_spec("optimum.quanto") is not None
HAS_HQQ = importlib.util.find_spec("hqq") is not None
BASE = ["--engine", "transformers", "--model", "tiny", "--reps", "1", "--warmup", "0",
        "--decode-tokens", "4", "--chunk-size", "64", "--no-report"]


def _engine(kv: str, path: str = "eager", capacity: int = 220, **options) -> TransformersEngine:
    eng = TransformersEngine(EngineSpec(model="tiny", kv=kv, path=path, chunk_size=64,
                                        capacity=capacity, options=options))
    eng.load()
    return eng


def _kl(base, other) -> float:
    return (base.exp() * (base - other)).sum(-1).mean().item()


def test_kv_and_path_names():
    assert parse_kv("dynamic") == KvArm("dynamic")
    assert parse_kv("quanto-int4") == KvArm("quanto", 4, 64)
    assert parse_kv("hqq-int2-g32") == KvArm("hqq", 2, 32)
    assert parse_kv("kvtax-int4-g32") == KvArm("kvtax", fmt="int4-g32")
    for bad in ("quanto-int8", "hqq-int5", "kvtax-int7", "fp16", "int8"):
        with pytest.raises(KVTaxError):
            parse_kv(bad)
    with pytest.raises(KVTaxError, match="no path"):
        TransformersEngine.arms(["dynamic"], ["fused"])
    arms = TransformersEngine.arms(["kvtax-int8", "static", "dynamic"], ["eager", "compiled"])
    assert len(arms) == 6 and TransformersEngine.baseline_arm(arms) == ("dynamic", "eager")
    assert get_engine("transformers") is TransformersEngine


def test_compiled_needs_a_compileable_cache():
    for kv in ("dynamic", "quanto-int4", "hqq-int4", "fp8"):
        why = arm_unavailable(parse_kv(kv), "compiled", "tiny")
        assert why and "compileable" in why
    for kv in ("static", "kvtax-int8"):
        assert arm_unavailable(parse_kv(kv), "compiled", "tiny") is None
    assert "eagerly" in arm_unavailable(parse_kv("kvtax-q4"), "compiled", "tiny")
    with pytest.raises(EngineUnavailable, match="compileable"):
        _engine("dynamic", "compiled")


def test_unquantized_caches_agree_and_quantized_ones_rank():
    """One model, one text: DynamicCache, StaticCache and kvtax's fp32 cache give the same
    log-probabilities; int8 is closer to them than int4."""
    eng = _engine("dynamic")
    ids = eng.prompt_ids(161, 5)
    lp = {kv: _engine(kv).logprobs(ids, 16) for kv in
          ("static", "kvtax-fp32", "kvtax-int8", "kvtax-int4")}
    lp["dynamic"] = eng.logprobs(ids, 16)
    assert eng.cache_bytes() == 4096 * 160  # what `kvtax quality` reports beside the KL
    assert lp["dynamic"].shape == (16, CFG.vocab_size)
    assert (lp["dynamic"] - lp["static"]).abs().max().item() < 1e-5
    assert (lp["dynamic"] - lp["kvtax-fp32"]).abs().max().item() < 1e-4
    assert 0 < _kl(lp["dynamic"], lp["kvtax-int8"]) < _kl(lp["dynamic"], lp["kvtax-int4"])


def test_hybrid_arm_runs_eagerly():
    """kvtax-q4 (fp16 sinks and recent tokens beside an int4 body) through the adapter:
    161 tokens, 29 of them read from the body; closer to DynamicCache than plain int4, and
    its bytes per token are the body's."""
    assert parse_kv("kvtax-q4") == KvArm("kvtax", fmt="q4")
    ids = _engine("dynamic").prompt_ids(161, 5)
    base = _engine("dynamic").logprobs(ids, 16)
    q4, int4 = _engine("kvtax-q4"), _engine("kvtax-int4")
    assert 0 < _kl(base, q4.logprobs(ids, 16)) < _kl(base, int4.logprobs(ids, 16))
    # 4 layers x 2 heads, K and V: int4 + metadata, and each key row's D/16 bytes (fifth bits,
    # channel order)
    assert q4.bytes_per_token() == 4 * 2 * 2 * (32 + 2 * 4) + 4 * 2 * 64 // 16


@pytest.mark.parametrize("kv, bpt", [
    ("dynamic", 4096),      # K and V, 64 float32 values each, 2 heads, 4 layers
    ("static", 4096),
    ("kvtax-int8", 1152),   # 64 code bytes + a float32 scale and bias per 64-group
    pytest.param("quanto-int4", 640, marks=pytest.mark.skipif(not HAS_QUANTO,
                                                             reason="optimum-quanto")),
    pytest.param("hqq-int4", 640, marks=pytest.mark.skipif(not HAS_HQQ, reason="hqq")),
    ("fp8", 1024),          # one byte a value, one scale per tensor
])
def test_bytes_per_token_and_resident_bytes(kv, bpt):
    eng = _engine(kv)
    eng.prefill(eng.prompt_ids(200, 0))
    eng.decode(2)
    assert eng.bytes_per_token() == bpt
    held, fp = eng.cache_bytes(), 4096  # 202 tokens: the prompt and two steps
    expected = {
        "dynamic": fp * 202,
        "static": fp * 220,                 # the whole preallocation
        "kvtax-int8": bpt * 256,            # kvtax grows its storage in 256-token steps
        "fp8": bpt * 202 + 2 * 4 * 4,       # + one float32 scale per layer for K and V
    }.get(kv, bpt * 192 + fp * 10)  # QuantizedCache: 3 chunks quantized, 10 fp residual
    assert held == expected
    eng.close()


@pytest.mark.skipif(not HAS_QUANTO, reason="optimum-quanto is not installed")
def test_quanto_requantizations_are_counted():
    """200 tokens in 64-token chunks with a 128-token residual: the first chunk initializes
    the quantized part, the third flushes the residual (two re-quantizations)."""
    eng = _engine("quanto-int4")
    eng.prefill(eng.prompt_ids(200, 0))
    eng.decode(2)
    info = eng.info()
    assert (info["prefill_growth_events"], info["decode_growth_events"]) == (2, 0)
    assert info["residual_length"] == 128 and "quanto" in info["quanto_unpack"]
    # the bench's int4/hf-quantized arm counts the same bytes: this arm can replace it
    from kvtax.harness.bench.hf_quantized import quantized_cache_bytes

    assert eng.cache_bytes() == quantized_cache_bytes(eng.cache)


def test_compiled_static_decode_gives_the_eager_tokens():
    """transformers' compiled decode step (dynamo with its eager backend, to stay fast on
    CPU) over a StaticCache: the same greedy tokens as eager, one graph, no break."""
    toks = {}
    for path in ("eager", "compiled"):
        eng = _engine("static", path, compile_backend="eager")
        eng.prefill(eng.prompt_ids(100, 2))
        out = [eng.last_token()]
        for _ in range(4):
            eng.decode(1)
            out.append(eng.last_token())
        toks[path] = out
        info = eng.info()
    assert toks["compiled"] == toks["eager"]
    assert info["compile"]["backend"] == "eager" and info["compile"]["warmup_s"] > 0
    assert info["dynamo"]["unique_graphs"] >= 1 and info["dynamo"]["graph_breaks"] == 0


def test_generate_and_text():
    eng = _engine("dynamic")
    ids = eng.prefix_ids() + eng.tokenize("hi")
    assert ids == [CFG.bos_token_id, *b"hi"] and eng.detokenize(list(b"ok")) == "ok"
    free = eng.generate(ids, 5)
    assert 0 < len(free) <= 5 and eng.generate(ids, 5, stop=lambda t: True) == free[:1]


def test_recall_through_the_engine(tmp_path):
    """Recall asks through generate/tokenize: rows per arm, the baseline asked first
    (random weights recall nothing; the answers still come back as text)."""
    from kvtax.harness.recall.probe import RecallConfig, run_recall
    from kvtax.harness.recall.engine import EngineRecallModel

    cfg = RecallConfig(model="tiny", contexts=[400], kvs=["dynamic", "kvtax-int8"], facts=2,
                       engine="transformers", max_new_tokens=6)
    rows = read_rows(run_recall(cfg, tmp_path, log=lambda _s: None,
                                model=EngineRecallModel(cfg)))
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    assert min(rows, key=lambda r: r["seq"])["arm"] == "dynamic/eager"
    assert {r["engine"] for r in rows} == {"transformers"}
    assert all(isinstance(r["answer"], str) for r in rows)


# ----------------------------------------------------------------------------- the CLI


def _bench(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtax", "bench", *args],
                          capture_output=True, text=True, timeout=600, env=env)


def _run_dir(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "runs"
    kvs = "dynamic,kvtax-int8" + (",quanto-int4" if HAS_QUANTO else "")
    proc = _bench(BASE + ["--contexts", "160", "--kv", kvs, "--paths", "eager",
                          "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return _run_dir(out)


def test_bench_rows_carry_the_arm_and_its_bytes(sweep):
    rows = {r["kv"]: r for r in read_rows(sweep)}
    assert {"dynamic", "kvtax-int8"} <= set(rows)
    for kv, r in rows.items():
        assert r["status"] == "ok", r.get("error")
        assert r["engine"] == "transformers"
        assert r["engine_version"].startswith("transformers ")
        assert r["memory_kind"] == "cpu_rss" and r["decode_peak_bytes"] > 0
        assert r["baseline_arm"] == "dynamic/eager" and len(r["decode_ms_samples"]) == 4
        assert r["engine_info"]["model_source"] == "built-in tiny (random weights)"
    assert rows["dynamic"]["engine_info"]["cache"] == "DynamicCache"
    assert rows["kvtax-int8"]["engine_info"]["attn_implementation"] == "kvtax"
    assert rows["kvtax-int8"]["bytes_per_token"] == 1152
    # the prompt, the first token's step and the settle step are held after prefill's row
    assert rows["dynamic"]["cache_bytes"] == 4096 * 160


def test_resume_runs_only_the_missing_cells(sweep, tmp_path):
    copy = tmp_path / "run"
    copy.mkdir()
    for f in sweep.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    lines = (copy / "rows.jsonl").read_text().splitlines(keepends=True)
    (copy / "rows.jsonl").write_text("".join(lines[:1]))
    proc = _bench(["--resume", str(copy), "--no-report"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 already done" in proc.stdout
    rows = read_rows(copy)
    assert sorted(r["cell_id"] for r in rows) == sorted(
        json.loads(ln)["cell_id"] for ln in lines)


def test_compiled_arms_run_or_say_why_not(tmp_path):
    proc = _bench(BASE + ["--contexts", "64", "--kv", "dynamic,static", "--paths",
                          "compiled", "--engine-option", "compile_backend=eager",
                          "--out", str(tmp_path / "runs")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["kv"]: r for r in read_rows(_run_dir(tmp_path / "runs"))}
    assert rows["dynamic"]["status"] == "unavailable"
    assert "compileable" in rows["dynamic"]["error"]
    ok = rows["static"]
    assert ok["status"] == "ok", ok.get("error")
    assert ok["engine_info"]["compile"]["backend"] == "eager"
    assert ok["engine_info"]["dynamo"]["graph_breaks"] == 0


def test_engine_error_becomes_a_row(tmp_path):
    broken = tmp_path / "broken"  # a HF folder without weights: from_pretrained raises
    broken.mkdir()
    # a complete config (kvtax reads it before any cell), but no weights
    (broken / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 320, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}))
    proc = _bench(BASE + ["--model", str(broken), "--contexts", "64", "--kv", "dynamic",
                          "--out", str(tmp_path / "runs")])
    assert proc.returncode == 1, proc.stderr[-2000:]  # nothing measured
    (row,) = read_rows(_run_dir(tmp_path / "runs"))
    assert row["status"] == "error" and row["phase"] == "setup"
    assert str(broken) in row["error"] or "model.safetensors" in row["error"]


def test_missing_transformers_is_one_line_naming_the_install(tmp_path):
    proc = _bench(BASE + ["--contexts", "64", "--out", str(tmp_path / "runs")],
                  env=hidden_env(tmp_path, ["transformers"]))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'kvtax[hf]'" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()
