"""benchmarks/attention.py's `kvtax-int4c64` arm (q4's body: K int4-c64, V int4-g32, one
plain view) in a dry run on CPU (the interpreter): both phases run the fused kernels, and
the TB/s column's bytes are the format's (72 + 80 bytes per token and head at D 128)."""

from __future__ import annotations

import json

import pytest

from kvtax.formats import KVSpec
from tests.support.scripts import run_benchmark

pytestmark = pytest.mark.kernels


def test_int4c64_arm_runs_both_phases_and_counts_its_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run = run_benchmark("attention.py", "--dry-run", "--arms", "kvtax-int4c64", "kvtax-int4",
                        "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    (rows_file,) = tmp_path.glob("*/rows.jsonl")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    ours = [r for r in rows if r["arm"] == "kvtax-int4c64"]
    assert {(r["phase"], r["ctx"]) for r in ours} == {(p, c) for p in ("decode", "prefill")
                                                      for c in (64, 96)}
    per_token = KVSpec.parse("k4-c64v4-g32").bytes_per_token(64)
    assert per_token == 76  # K 32 + 2 x 2 metadata bytes, V 32 + 2 groups x 2 x 2
    for r in ours:
        assert r["status"] == "ok", r["note"]
        q_bytes = 2 * r["batch"] * r["q_heads"] * r["rows"] * r["head_dim"] * 2
        assert r["bytes"] == per_token * r["batch"] * r["kv_heads"] * r["ctx"] + q_bytes
        int4 = next(x for x in rows if x["arm"] == "kvtax-int4" and x["phase"] == r["phase"]
                    and x["ctx"] == r["ctx"])
        # random (outlier-free) keys: both 4-bit formats land near the same error
        assert r["rel_err_vs_fp16"] < 1.5 * int4["rel_err_vs_fp16"]
