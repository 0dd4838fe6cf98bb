"""`kvtax recall --engine` and `kvtax quality --engine` through the engine interface: on the
fake engine (exact expectations), and kvtax's own runner as an Engine cross-checked with
the existing kvtax recall / quality paths on the tiny model."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.support.engine_env import fake_engine_env
from tests.support.fake_engine import FakeEngine
from kvtax.cli import main
from kvtax.harness.engines import ENGINES, EngineSpec
from kvtax.harness.quality.probe import (
    QualityConfig,
    run_quality,
    text_fingerprint,
    text_ids,
    text_of,
)
from kvtax.harness.quality.engine import EngineQuality, EngineText, run_engine_quality
from kvtax.harness.quality.metrics import kl_divergence
from kvtax.harness.recall.probe import RecallConfig, run_recall
from kvtax.harness.recall.engine import EngineRecallModel
from kvtax.harness.store import read_rows


@pytest.fixture
def fake_here(monkeypatch, tmp_path):
    fake_engine_env(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(ENGINES, "fake", "tests.support.fake_engine")


def _run(out):
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def test_recall_through_an_engine_grades_each_arm(fake_here, tmp_path):
    out = tmp_path / "runs"
    assert main(["recall", "--engine", "fake", "--kv", "q4,f16", "--contexts", "700",
                 "--facts", "3", "--out", str(out), "--no-report"]) == 0
    rows = read_rows(_run(out))
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)
    assert {r["engine"] for r in rows} == {"fake"}
    assert {r["engine_version"] for r in rows} == {"kvtax-fake-backend 1.2.3"}
    first = min(rows, key=lambda r: r["seq"])
    assert first["arm"] == "f16/a"  # the engine's baseline is asked first
    assert all(r["correct"] for r in rows if r["kv"] == "f16")
    assert not any(r["correct"] for r in rows if r["kv"] == "q4")


def test_recall_refuses_an_unknown_engine_arm_in_one_line(fake_here, tmp_path, capsys):
    assert main(["recall", "--engine", "fake", "--kv", "f16,q3", "--contexts", "700",
                 "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown kv 'q3'" in err[0]
    assert not (tmp_path / "runs").exists()


def _fake_logp(kv: str, ids: list[int], tail: int) -> torch.Tensor:
    eng = FakeEngine(EngineSpec(model="m", kv=kv, path="a"))
    return eng.logprobs(ids, tail)


def test_quality_scores_arms_against_the_same_engines_baseline(fake_here, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "runs"
    assert main(["quality", "--engine", "fake", "--kv", "q4,q8,f16", "--contexts", "48,80",
                 "--tail", "16", "--text", str(text), "--out", str(out), "--no-report"]) == 0
    run = _run(out)
    rows = {(r["kv"], r["context"]): r for r in read_rows(run)}
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows.values())
    ids = text_ids(EngineText(FakeEngine(EngineSpec(model="m", kv="f16", path="a"))),
                   text_of(str(text)), 81)
    env = json.loads((run / "env.json").read_text())  # which tokens were scored, kept
    assert env["token_ids_sha256"] == text_fingerprint(text.read_text(), ids)["token_ids_sha256"]
    assert env["text_tokens"] == 81 and "device" in env
    for ctx in (48, 80):
        base = _fake_logp("f16", ids[: ctx + 1], 16)
        assert rows[("f16", ctx)]["kl"] == 0 and rows[("f16", ctx)]["top1"] == 1
        for kv in ("q8", "q4"):
            want = kl_divergence(base, _fake_logp(kv, ids[: ctx + 1], 16)).mean().item()
            assert rows[(kv, ctx)]["kl"] == pytest.approx(want, rel=1e-9)
            assert rows[(kv, ctx)]["baseline"] == "f16/a"
            assert rows[(kv, ctx)]["ppl_base"] == rows[("f16", ctx)]["ppl"]
        assert rows[("q8", ctx)]["kl"] < rows[("q4", ctx)]["kl"]
    # resume: drop the q4 rows, the rerun writes them again and nothing else
    lines = (run / "rows.jsonl").read_text().splitlines(keepends=True)
    (run / "rows.jsonl").write_text("".join(ln for ln in lines if '"kv": "q4"' not in ln))
    assert main(["quality", "--resume", str(run), "--no-report"]) == 0
    again = read_rows(run)
    assert sorted((r["kv"], r["context"]) for r in again) == sorted(rows)


def test_kvtax_engine_quality_matches_the_kvtax_quality_path(tmp_path):
    """The runner as an Engine (logprobs) gives the KL the existing quality path measures."""
    cfg = QualityConfig(model="tiny", contexts=[40], kvs=["int4"], tail=8, chunk_size=16)
    legacy = read_rows(run_quality(cfg, tmp_path / "a", log=lambda _s: None))
    cfg_e = QualityConfig(model="tiny", contexts=[40], kvs=["fp16", "int4"], tail=8,
                          chunk_size=16, baseline="")
    generic = read_rows(run_engine_quality(cfg_e, EngineQuality("kvtax"), tmp_path / "b",
                                           log=lambda _s: None))
    a = {r["kv"]: r for r in legacy}
    b = {r["kv"]: r for r in generic}
    assert b["int4"]["engine"] == "kvtax" and b["int4"]["arm"] == "int4/fused"
    assert b["int4"]["kl"] > 0
    assert b["int4"]["kl"] == pytest.approx(a["int4"]["kl"], rel=1e-4)
    assert b["int4"]["top1"] == a["int4"]["top1"]
    assert b["fp16"]["ppl"] == pytest.approx(a["fp16"]["ppl"], rel=1e-5)


def test_kvtax_engine_recall_matches_the_kvtax_recall_path(tmp_path):
    """Engine.generate on kvtax's runner answers what kvtax's own recall path answers."""
    cfg = RecallConfig(model="tiny", contexts=[448], kvs=["int8"], facts=2, engine="kvtax",
                       max_new_tokens=6)
    legacy = read_rows(run_recall(cfg, tmp_path / "a", log=lambda _s: None))
    generic = read_rows(run_recall(cfg, tmp_path / "b", log=lambda _s: None,
                                   model=EngineRecallModel(cfg)))
    assert [r["answer"] for r in generic] == [r["answer"] for r in legacy]
    assert all(r["status"] == "ok" for r in generic)
    assert {r["engine_version"] for r in generic} == {"kvtax 0.1.0"}


@pytest.mark.parametrize("command", ["recall", "quality"])
def test_missing_engine_package_is_one_line_before_any_folder(monkeypatch, tmp_path, capsys,
                                                              command):
    fake_engine_env(tmp_path, installed=False)  # the entry point, not its backend package
    monkeypatch.delitem(sys.modules, "kvtax_fake_backend", raising=False)  # earlier tests'
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(ENGINES, "fake", "tests.support.fake_engine")
    assert main([command, "--engine", "fake", "--contexts", "700", "--out",
                 str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install kvtax-fake-backend" in err[0]
    assert not (tmp_path / "runs").exists()
