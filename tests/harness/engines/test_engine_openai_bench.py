"""`kvtax bench --engine openai` end to end: two real servers started here on 127.0.0.1
(llama-cpp-python's, SmolLM2's GGUF, one with an f16 KV cache and one with q8_0 K/V and
flash attention), one arm each, plus a third URL where nothing listens; then a resume.
Both servers are always stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtax.harness.schema import validate_row
from kvtax.harness.store import read_rows
from tests.support.openai_server import free_port, smol_gguf, start_server, stop_server

BASE = ["--engine", "openai", "--contexts", "32", "--reps", "1", "--warmup", "0",
        "--decode-tokens", "3", "--no-report"]
Q8_0 = "8"  # ggml's type id, as llama-cpp-python's server takes --type_k / --type_v


def _bench(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtax", "bench", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[subprocess.Popen, str]]]:
    gguf = smol_gguf()
    started: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        started["f16"] = start_server(gguf)
        started["q8"] = start_server(gguf, "--type_k", Q8_0, "--type_v", Q8_0,
                                     "--flash_attn", "True")
        yield started
    finally:
        for proc, _ in started.values():
            stop_server(proc)


@pytest.fixture(scope="module")
def sweep(servers, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("openai") / "runs"
    urls = [f"--url={name}={url}" for name, (_, url) in servers.items()]
    dead = f"--url=gone=http://127.0.0.1:{free_port()}"
    proc = _bench(BASE + [*urls, dead, "--engine-option", "timeout_s=20", "--out", str(out)])
    # exit 3: some cells failed (the dead server's), the others measured
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "2 of 3 cells measured; 1 failed" in proc.stderr
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def test_one_row_per_server_with_its_own_memory(sweep: Path, servers) -> None:
    rows = {r["arm"]: r for r in read_rows(sweep)}
    assert sorted(rows) == ["f16/server", "gone/server", "q8/server"]
    for name in ("f16", "q8"):
        r = rows[f"{name}/server"]
        validate_row(r)
        assert r["status"] == "ok", r["error"]
        assert r["engine"] == "openai" and r["baseline_arm"] == "f16/server"
        info = r["engine_info"]
        assert info["url"] == servers[name][1] and info["server_pid"] == servers[name][0].pid
        assert info["prompt_tokens_exact"] is True and info["prompt_tokens_approx"] is False
        assert r["memory_kind"] == "server_rss" and r["prefill_peak_bytes"] > 50 * 2**20
        assert r["ttft_s"] > 0 and len(r["decode_ms_samples"]) == 3
        # prompt's first token + settle step + 3 timed: the stream ran to its end
        assert info["stream_chunks"] == 5


def test_unreachable_server_is_an_error_row(sweep: Path) -> None:
    (gone,) = [r for r in read_rows(sweep) if r["arm"] == "gone/server"]
    assert gone["status"] == "error" and gone["phase"] == "setup"
    assert "unreachable" in gone["error"]


def test_resume_reruns_only_the_missing_arm(sweep: Path, servers, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    copy.mkdir()
    for f in sweep.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    lines = (copy / "rows.jsonl").read_text().splitlines(keepends=True)
    (copy / "rows.jsonl").write_text("".join(
        ln for ln in lines if json.loads(ln)["arm"] != "q8/server"))
    proc = _bench(["--resume", str(copy), "--no-report"])
    assert proc.returncode == 3, proc.stderr[-2000:]  # the dead server's row is still a failure
    assert "2 already done" in proc.stdout
    (redo,) = [r for r in read_rows(copy) if r["arm"] == "q8/server"]
    assert redo["status"] == "ok" and redo["engine_info"]["url"] == servers["q8"][1]
