"""`kvtax bench --engine llama.cpp` end to end on SmolLM2-135M's GGUF (CPU, 2 threads,
a 32-token context): rows, an arm llama.cpp refuses, resume, a broken GGUF as error
rows, and a missing llama-cpp-python as one line naming the install command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtax.harness.analysis.analyze import summarize
from kvtax.harness.engines import llamacpp_kv as kvt
from kvtax.harness.schema import validate_row
from kvtax.harness.analysis.stats import points
from kvtax.harness.store import read_rows

BASE = ["--engine", "llama.cpp", "--contexts", "32", "--reps", "1", "--warmup", "0",
        "--decode-tokens", "2", "--threads", "2", "--chunk-size", "32", "--no-report"]


def _bench(args: list[str], pre: str = "pass") -> subprocess.CompletedProcess:
    code = f"import sys; {pre}; from kvtax.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "bench", *args],
                          capture_output=True, text=True, timeout=300)


def _run_dir(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run




@pytest.fixture(scope="module")
def sweep(gguf: str, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llamacpp") / "runs"
    proc = _bench(BASE + ["--model", gguf, "--kv", "f16,q8_0:q4_0", "--flash-attn", "on,off",
                          "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return _run_dir(out)


def test_rows_say_what_llama_cpp_ran(sweep: Path) -> None:
    rows = {r["arm"]: r for r in read_rows(sweep)}
    assert sorted(rows) == ["f16/fa", "f16/nofa", "q8_0:q4_0/fa", "q8_0:q4_0/nofa"]
    for arm, r in rows.items():
        validate_row(r)
        assert r["engine"] == "llama.cpp" and r["engine_version"].startswith("llama-cpp-python ")
        if arm == "q8_0:q4_0/nofa":
            continue
        assert r["status"] == "ok", r["error"]
        info = r["engine_info"]
        assert info["path_ran"] == r["path"] and info["arm_as_requested"] is True
        assert info["n_threads"] == 2 and info["n_batch"] == 32
        assert r["bytes_per_token"] == kvt.bytes_per_token(r["kv"], 30, 3, 64, 64)
        assert abs(r["cache_bytes"] - r["bytes_per_token"] * info["n_ctx"]) <= 0.02 * 2**20
        assert r["memory_kind"] == "cpu_rss" and r["prefill_peak_bytes"] > 50 * 2**20
        assert r["ttft_s"] > 0 and len(r["decode_ms_samples"]) == 2
        assert r["baseline_arm"] == "f16/fa"


def test_refused_arm_is_an_unavailable_row(sweep: Path) -> None:
    """A quantized V cache without flash attention: llama.cpp refuses; the row says so
    and the statistics leave the arm out instead of comparing it."""
    rows = read_rows(sweep)
    (bad,) = [r for r in rows if r["arm"] == "q8_0:q4_0/nofa"]
    assert bad["status"] == "unavailable" and "requires it" in bad["error"]
    assert bad["ttft_s"] is None
    a = summarize(rows)
    # the baseline is the faster of the two f16 arms (timing decides which: both are fine)
    assert a["baseline"] in ("f16/fa", "f16/nofa")
    assert "q8_0:q4_0/nofa" not in a.get("slope_ratios", {})


def test_arm_that_ran_otherwise_is_flagged_not_compared(sweep: Path) -> None:
    """Rows whose engine reports another setting than asked (llama.cpp's auto turning
    flash attention off) are left out of the fits, with the reason named."""
    rows = read_rows(sweep)
    for r in rows:
        if r["arm"] == "f16/nofa":
            r["engine_info"].update(arm_as_requested=False, arm_note="asked nofa, ran fa")
    (pt,) = [p for p in points(rows) if p.arm == "f16/nofa"]
    assert pt.flagged and pt.reason == "not run as asked: asked nofa, ran fa"
    assert not any(p.flagged for p in points(rows) if p.arm == "f16/fa")


def test_resume_runs_only_the_missing_cell(sweep: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    copy.mkdir()
    for f in sweep.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    lines = (copy / "rows.jsonl").read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if json.loads(ln)["arm"] != "f16/nofa"]
    (copy / "rows.jsonl").write_text("".join(kept))
    proc = _bench(["--resume", str(copy), "--no-report"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3 already done" in proc.stdout
    rows = read_rows(copy)
    assert sorted(r["arm"] for r in rows) == sorted(json.loads(ln)["arm"] for ln in lines)
    (redo,) = [r for r in rows if r["arm"] == "f16/nofa"]
    assert redo["status"] == "ok" and redo["engine_info"]["path_ran"] == "nofa"


def test_unreadable_gguf_is_refused_before_any_cell(tmp_path: Path) -> None:
    """A file kvtax cannot read a config from: one line, exit 2, no run folder."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                                            "'kvtax[llamacpp]')")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    proc = _bench(BASE + ["--model", str(bad), "--kv", "f16", "--out", str(tmp_path / "r")])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "GGUF" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


def test_gguf_llama_cpp_cannot_load_becomes_error_rows(gguf: str, tmp_path: Path) -> None:
    """Metadata kvtax reads (block_count one past the tensors) but llama.cpp refuses: the
    failure is the cell's row (status error, phase setup) and the exit status says so (1)."""
    from gguf import GGUFReader

    bad = tmp_path / "one-block-short.gguf"
    bad.write_bytes(Path(gguf).read_bytes())
    field = GGUFReader(str(bad), "r+").fields["llama.block_count"]
    field.parts[field.data[0]][0] += 1  # in place: the file now promises a block it lacks
    proc = _bench(BASE + ["--model", str(bad), "--kv", "f16", "--out", str(tmp_path / "r")])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "0 of 1 cells measured; 1 failed" in proc.stderr
    (row,) = read_rows(_run_dir(tmp_path / "r"))
    assert row["status"] == "error" and row["phase"] == "setup"
    assert "Failed to load model" in row["error"]


def test_missing_llama_cpp_is_one_line_naming_the_install(tmp_path: Path) -> None:
    """llama_cpp made unimportable in the child: exit 2 before any folder or cell."""
    proc = _bench(BASE + ["--model", "x.gguf", "--out", str(tmp_path / "runs")],
                  pre="sys.modules['llama_cpp'] = None")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'kvtax[llamacpp]'" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()
