"""`kvtax bench --engine NAME` end to end on a fake engine (tests/support/fake_engine.py):
rows carry the engine, its version, settings and info; per-phase peaks come from the
engine's own counter; resume, errors as rows, a missing package, bad arms; statistics
use the engine's own baseline and bytes per token; `kvtax report A B` across engines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engine_env import BACKEND_VERSION, fake_engine_env
from tests.support.fake_engine import BPT, SCRATCH
from kvtax.cli import main
from kvtax.harness.analysis.analyze import summarize
from kvtax.harness.engines import ENGINES
from kvtax.harness.bench.plan import SweepConfig, plan_cells
from kvtax.harness.schema import base_row, make_cell_id, validate_row
from kvtax.harness.store import RunStore, read_rows

BASE = ["--engine", "fake", "--contexts", "16,32,64", "--reps", "1", "--warmup", "0",
        "--decode-tokens", "3", "--no-report"]


def _bench(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtax", "bench", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def _run_dir(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One fake sweep of three kvs x two paths, shared by the row checks."""
    tmp = tmp_path_factory.mktemp("fake")
    env = fake_engine_env(tmp)
    out = tmp / "runs"
    proc = _bench(BASE + ["--kv", "f16,q8,q4", "--paths", "a,b", "--threads", "2",
                          "--chunk-size", "8", "--out", str(out)], env)
    assert proc.returncode == 0, proc.stderr
    return _run_dir(out), env, proc


def test_rows_carry_engine_version_settings_and_info(sweep):
    run, _, proc = sweep
    rows = read_rows(run)
    assert len(rows) == 3 * 2 * 3 and all(r["status"] == "ok" for r in rows), proc.stdout
    for r in rows:
        validate_row(r)
        assert r["engine"] == "fake"
        assert r["engine_version"] == f"kvtax-fake-backend {BACKEND_VERSION}"
        spec = r["engine_spec"]
        assert (spec["kv"], spec["path"], spec["threads"], spec["chunk_size"]) == (
            r["kv"], r["path"], 2, 8)
        assert spec["capacity"] == r["context"] + 3 + 2
        # info() is read after decode: prompt + first token + settle step + 3 steps held
        assert r["engine_info"] == {"attention": f"fake-{r['path']}",
                                    "held": r["context"] + 1 + 1 + 3}
        assert r["baseline_arm"] == "f16/a"
        assert r["memory_kind"] == "fake_bytes"


def test_phase_peaks_come_from_the_engines_counter(sweep):
    """Warm-up then reset leaves an empty cache: prefill's peak is the prompt, its first
    token and prefill's transient; decode's is everything held at its end, without the
    transient (its counter was reset at the phase start)."""
    for r in read_rows(sweep[0]):
        bpt, ctx = BPT[r["kv"]], r["context"]
        assert r["bytes_per_token"] == bpt
        assert r["prefill_base_bytes"] == 0
        assert r["prefill_peak_bytes"] == (ctx + 1) * bpt + SCRATCH * ctx
        assert r["cache_bytes"] == (ctx + 1) * bpt
        assert r["decode_base_bytes"] == (ctx + 2) * bpt
        assert r["decode_peak_bytes"] == (ctx + 5) * bpt
        assert len(r["decode_ms_samples"]) == 3 and r["ttft_s"] > 0


def test_stats_use_the_engines_baseline_and_bytes_per_token(sweep):
    a = summarize(read_rows(sweep[0]))
    assert a["baseline"] == "f16/a"
    for kv in ("q8", "q4"):
        sr = a["slope_ratios"][f"{kv}/a"]
        assert sr["predicted"] == pytest.approx(BPT["f16"] / BPT[kv])
        assert sr["measured"] == pytest.approx(BPT["f16"] / BPT[kv], rel=1e-3)


@pytest.fixture
def fake_here(monkeypatch, tmp_path):
    """The fake engine registered and "installed" in this process too."""
    fake_engine_env(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(ENGINES, "fake", "tests.support.fake_engine")


def test_resume_runs_only_the_missing_cells(sweep, tmp_path, fake_here):
    run, env, _ = sweep
    copy = tmp_path / "run"
    copy.mkdir()
    for f in run.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    lines = (copy / "rows.jsonl").read_text().splitlines(keepends=True)
    (copy / "rows.jsonl").write_text("".join(lines[:7]))
    proc = _bench(["--resume", str(copy), "--no-report"], env)
    assert proc.returncode == 0, proc.stderr
    assert "11 already done" not in proc.stdout and "7 already done" in proc.stdout
    rows = read_rows(copy)
    cfg = SweepConfig.from_dict(json.loads((copy / "config.json").read_text()))
    assert cfg.engine == "fake"
    assert sorted(r["cell_id"] for r in rows) == sorted(c.cell_id for c in plan_cells(cfg))


def test_engine_error_becomes_a_row_and_keeps_earlier_phases(tmp_path):
    env = fake_engine_env(tmp_path)
    proc = _bench(BASE + ["--kv", "f16,q4", "--engine-option", "fail=q4:decode",
                          "--out", str(tmp_path / "runs")], env)
    assert proc.returncode == 3, proc.stderr  # some cells failed: kvtax.cli.outcome
    rows = read_rows(_run_dir(tmp_path / "runs"))
    bad = [r for r in rows if r["kv"] == "q4"]
    assert bad and all(r["status"] == "error" and r["phase"] == "decode" for r in bad)
    assert all("failed in decode on purpose" in r["error"] for r in bad)
    assert all(r["ttft_s"] > 0 and r["decode_ms_per_token"] is None for r in bad)
    # info() is still read: what the engine ran up to the failure (prompt, first, settle)
    assert all(r["engine_info"]["held"] == r["context"] + 2 for r in bad)
    assert all(r["engine_spec"]["options"]["fail"] == "q4:decode" for r in rows)
    assert all(r["status"] == "ok" for r in rows if r["kv"] == "f16")


def test_missing_engine_package_is_one_line_naming_the_install(tmp_path):
    env = fake_engine_env(tmp_path, installed=False)
    proc = _bench(BASE + ["--out", str(tmp_path / "runs")], env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install kvtax-fake-backend" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()  # stopped before any folder or cell


@pytest.mark.parametrize("args, needle", [
    (["--kv", "q3"], "unknown kv 'q3'"),
    (["--engine", "nope"], "unknown engine 'nope'"),
    (["--flash-attn", "maybe"], "--flash-attn takes on, off"),
    (["--level", "attention"], "whole models"),
], ids=["bad-kv", "bad-engine", "bad-flash-attn", "attention-level"])
def test_bad_engine_arguments_exit_2_with_one_line(tmp_path, fake_here, capsys, args, needle):
    assert main(["bench", *BASE, "--out", str(tmp_path / "runs"), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err
    assert not (tmp_path / "runs").exists()


def test_kvtax_cell_ids_do_not_change_with_the_engine_fields():
    """Runs made before engines existed must resume: kvtax ids hash no engine keys."""
    cell = plan_cells(SweepConfig(contexts=[16], kvs=["fp16"], paths=["fused"], reps=1,
                                  warmup=0))[0]
    d = cell.to_dict()
    del d["cell_id"], d["seq"], d["order_seed"], d["engine"], d["engine_options"]
    assert make_cell_id(d) == cell.cell_id
    other = plan_cells(SweepConfig(contexts=[16], kvs=["fp16"], paths=["fused"], reps=1,
                                   warmup=0, engine_options={"x": 1}))[0]
    assert other.cell_id != cell.cell_id


def _kvtax_run(root: Path) -> Path:
    """A kvtax run at the fake sweep's contexts: fp16 and int8 on the fused path, planted
    slopes in the ratio 1.9 and bytes per token 4096 / 2176."""
    store = RunStore.create(root, "kvtax", {"kind": "bench"})
    slope, bpt = {"fp16": 1e-3, "int8": 1e-3 / 1.9}, {"fp16": 4096, "int8": 2176}
    for seq, (kv, ctx) in enumerate((k, c) for k in slope for c in (16, 32, 64)):
        params = {"kind": "bench", "model": "m", "arm": f"{kv}/fused", "context": ctx,
                  "rep": 0, "warmup": False}
        row = base_row({"cell_id": make_cell_id(params), "seq": seq, "order_seed": 0,
                        "kv": kv, "path": "fused", **params},
                       run_id=store.run_id, device="cpu", git_commit=None)
        ms = 2.0 + slope[kv] * ctx
        row.update(status="ok", ttft_s=0.1, decode_ms_per_token=ms, decode_ms_samples=[ms],
                   bytes_per_token=bpt[kv], engine_version="kvtax 0.1.0")
        store.append(row)
    return store.path


def _md_row(md: str, *cells: str) -> list[str]:
    for line in md.splitlines():
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if parts[: len(cells)] == list(cells):
            return parts
    raise AssertionError(f"no table row starting {cells}")


def test_report_compares_engines_side_by_side(sweep, tmp_path):
    """`kvtax report A B` on a fake-engine run and a kvtax run: one table keyed by
    (engine, arm), each slope ratio against its own run's baseline and bytes."""
    pytest.importorskip("matplotlib")
    kvtax_run = _kvtax_run(tmp_path)
    assert main(["report", str(sweep[0]), str(kvtax_run)]) == 0
    (out,) = sweep[0].glob("compare-*.md")
    md = out.read_text()
    assert "## Engines and arms side by side" in md
    q8 = _md_row(md, "A", f"fake (kvtax-fake-backend {BACKEND_VERSION})", "q8/a")
    assert float(q8[-2]) == pytest.approx(64 / 34, rel=2e-3)   # measured slope ratio
    assert float(q8[-1]) == pytest.approx(64 / 34, rel=2e-3)   # bytes predict
    assert q8[-3] == "34"
    _md_row(md, "A", f"fake (kvtax-fake-backend {BACKEND_VERSION})", "f16/a *")
    int8 = _md_row(md, "B", "kvtax (kvtax 0.1.0)", "int8/fused")
    assert float(int8[-2]) == pytest.approx(1.9, rel=2e-3)
    assert float(int8[-1]) == pytest.approx(4096 / 2176, rel=2e-3)
