"""Sweeps end to end on CPU: failures become rows, SIGKILL + resume loses and repeats nothing,
and `kvtax bench` writes a complete run folder."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtax.harness.bench.executor import ForkserverExecutor, SubprocessExecutor
from kvtax.harness.bench.plan import SweepConfig, plan_cells
from kvtax.harness.schema import validate_row
from kvtax.harness.store import read_rows

ATTN = ["--level", "attention", "--model", "attn-test", "--heads", "4/2", "--head-dim", "32"]


def _bench(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtax", "bench", *args], capture_output=True, text=True,
        timeout=240, **kw,
    )


def _run_dir(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def _planned(run: Path) -> list[str]:
    cfg = SweepConfig.from_dict(json.loads((run / "config.json").read_text()))
    return [c.cell_id for c in plan_cells(cfg)]


def test_sigkill_mid_sweep_then_resume_loses_and_duplicates_nothing(tmp_path):
    args = ATTN + ["--contexts", "16,32,48", "--kv", "fp16,int8", "--paths", "fused,unfused",
                   "--reps", "2", "--decode-tokens", "2", "--out", str(tmp_path), "--no-report"]
    proc = subprocess.Popen([sys.executable, "-m", "kvtax", "bench", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        rows_file = None
        while time.monotonic() < deadline:
            found = list(tmp_path.glob("*/rows.jsonl"))
            if found and len(found[0].read_text().splitlines()) >= 4:
                rows_file = found[0]
                break
            assert proc.poll() is None, "the sweep ended before it could be killed"
            time.sleep(0.05)
        assert rows_file is not None, "no rows appeared in time"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    run = rows_file.parent
    planned = _planned(run)
    before = [r["cell_id"] for r in read_rows(run)]
    assert 4 <= len(before) < len(planned), "kill landed after the sweep finished"

    res = _bench(["--resume", str(run), "--no-report"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "already done" in res.stdout
    rows = read_rows(run)
    ids = [r["cell_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a cell was measured twice"
    assert sorted(ids) == sorted(planned), "a planned cell is missing"
    assert ids[: len(before)] == before  # earlier rows untouched
    for r in rows:
        validate_row(r)
        assert r["status"] == "ok", r
    env = json.loads((run / "env.json").read_text())
    assert env["previous"], "the first run's environment was kept"


def test_forced_oom_becomes_a_row_and_the_sweep_goes_on(tmp_path):
    args = ATTN + ["--contexts", "16,32", "--kv", "fp16,int8", "--paths", "fused", "--reps", "1",
                   "--warmup", "0", "--decode-tokens", "2", "--out", str(tmp_path),
                   "--no-report", "--force-oom", "decode:int8"]
    res = _bench(args)
    assert res.returncode == 3, res.stderr[-2000:]  # some cells failed (kvtax.cli.outcome)
    assert res.stderr.strip().splitlines()[-1].startswith(
        "kvtax bench: 2 of 4 cells measured; 2 failed: oom in decode: ")
    rows = read_rows(_run_dir(tmp_path))
    assert len(rows) == 4
    for r in rows:
        validate_row(r)
        if r["kv"].startswith("int8"):
            assert r["status"] == "oom" and r["phase"] == "decode", r
            assert "OutOfMemoryError" in r["error"]
            assert r["ttft_s"] is not None  # prefill was measured before decode failed
        else:
            assert r["status"] == "ok", r
    assert "oom in decode" in res.stdout


@pytest.fixture(scope="module")
def fork_executor():
    ex = ForkserverExecutor(timeout_s=120)
    yield ex
    ex.close()


def _cell(**kw) -> dict:
    cfg = SweepConfig(level="attention", model="attn-test", contexts=[kw.pop("context", 64)],
                      kvs=["int8"], paths=["fused"], reps=1, warmup=0, decode_tokens=2,
                      heads=4, kv_heads=2, head_dim=32)
    cell = plan_cells(cfg)[0].to_dict()
    cell.update(run_id="t", device_name="cpu", git_commit=None, **kw)
    return cell


def test_real_allocation_failure_under_memory_limit_is_an_oom_row(fork_executor):
    """RLIMIT_AS caps the child; a prefill whose chunk needs GBs fails to allocate for real."""
    cell = _cell(context=4_000_000, mem_limit_bytes=64 << 20)
    cell["chunk_size"] = 4_000_000
    row = fork_executor.run(cell)
    validate_row(row)
    assert row["status"] == "oom", row
    assert row["phase"] == "setup"  # the prompt's K/V chunk is allocated before prefill
    ok = fork_executor.run(_cell())  # the server survives and the next cell runs
    assert ok["status"] == "ok", ok


def test_timeout_row_names_the_phase(fork_executor):
    slow = _cell(context=64)
    slow["decode_tokens"] = 10**7
    fork_executor.timeout_s = 3.0
    try:
        row = fork_executor.run(slow)
    finally:
        fork_executor.timeout_s = 120
    validate_row(row)
    assert row["status"] == "timeout" and row["phase"] == "decode", row


def test_child_killed_from_outside_is_an_error_row(fork_executor):
    """What the kernel's OOM killer does: SIGKILL, no row. The parent still writes one."""
    import threading

    import psutil

    slow = _cell(context=64)
    slow["decode_tokens"] = 10**7
    result = {}
    t = threading.Thread(target=lambda: result.update(row=fork_executor.run(slow)))
    t.start()
    server = psutil.Process(fork_executor.proc.pid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not server.children():
        time.sleep(0.05)
    time.sleep(1.0)
    for child in server.children():
        child.send_signal(signal.SIGKILL)
    t.join(60)
    row = result["row"]
    validate_row(row)
    assert row["status"] == "error" and "SIGKILL" in row["error"], row
    assert row["phase"] in ("setup", "prefill", "decode")


def test_cell_error_is_a_row_with_its_text():
    row = SubprocessExecutor(timeout_s=120).run(_cell(kv="int9"))
    validate_row(row)
    assert row["status"] == "error" and row["phase"] == "setup", row
    assert "int9" in row["error"]


def test_kvtax_bench_end_to_end_writes_a_complete_run_folder(tmp_path):
    claims = tmp_path / "claims.json"
    claims.write_text(json.dumps([
        {"metric": "slope_ratio", "arm": "int8", "range": [0.1, 10]},
        {"metric": "decode_peak_le_fp16", "arm": "int8"},
        {"metric": "slope_ratio", "arm": "int4", "range": [3, 4]},  # no int4 arm: unmeasurable
    ]))
    out = tmp_path / "runs"
    args = ["--contexts", "32,64", "--reps", "2", "--warmup", "1", "--kv", "fp16,int8",
            "--paths", "fused,fp16,unfused,dequant,hf-quantized", "--decode-tokens", "3",
            "--out", str(out), "--claims", str(claims)]
    res = _bench(args)
    assert res.returncode == 0, res.stderr[-3000:]
    run = _run_dir(out)
    for name in ("config.json", "env.json", "rows.jsonl", "analysis.json"):
        assert (run / name).exists(), name
    env = json.loads((run / "env.json").read_text())
    for key in ("device", "torch", "triton", "transformers", "git_commit", "hostname", "cpu"):
        assert key in env
    rows = read_rows(run)
    assert sorted(r["cell_id"] for r in rows) == sorted(_planned(run))
    arms = {r["arm"] for r in rows}
    assert arms == {"fp16/fused", "int8/fused", "fp16/fp16", "int8/unfused", "int8/dequant",
                    "int8/hf-quantized"}
    for r in rows:
        validate_row(r)
        if r["path"] == "hf-quantized":
            assert r["status"] in ("unavailable", "ok"), r
            continue
        assert r["status"] == "ok", r
        assert r["level"] == "model" and r["model"] == "tiny"
        assert r["decode_growth"] is False  # contexts far from a growth boundary
        assert len(r["decode_ms_samples"]) == 3
        assert r["cache_bytes"] >= r["cache_used_bytes"] > 0
    warm = [r for r in rows if r["warmup"]]
    assert len(warm) == len(arms)
    orders = {r["order_seed"] for r in rows}
    assert orders == {0}
    assert sorted(r["seq"] for r in rows) == list(range(len(rows)))
    analysis = json.loads((run / "analysis.json").read_text())
    analysis = analysis.get("bench", analysis)  # the report nests the bench summary
    judged = analysis["baseline_candidates"]  # the best fp16 arm, whichever it is here
    assert set(judged) == {"fp16/fused", "fp16/fp16"}
    assert analysis["baseline"] == min(judged, key=judged.get)
    assert set(analysis["decode_points"]) >= {"fp16/fused", "int8/fused"}
    verdicts = [c["verdict"] for c in analysis["claims"]]
    assert len(verdicts) == 3 and verdicts[2] == "not measurable"
    assert set(verdicts) <= {"held", "failed", "not measurable"}
    assert res.stdout.count("claim:") == 3
    assert "[" in res.stdout and "ETA" in res.stdout
    try:
        import kvtax.harness.report.write  # noqa: F401
    except ImportError:
        return
    assert (run / "report.md").exists() and "report:" in res.stdout
