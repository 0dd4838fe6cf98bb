"""benchmarks/attention.py's int4-c64 arms (`kvtax-int4c64`, q4's body: K int4-c64, V
int4-g32, one plain view; `kvtax-k4c64v4`: V int4) in a dry run on CPU (the interpreter):
both phases run the fused kernels, and the TB/s column's bytes are the format's."""

from __future__ import annotations

import json

import pytest

from kvtax.formats import KVSpec
from tests.support.scripts import run_benchmark

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("arm, spec, per_token", [
    ("kvtax-int4c64", "k4-c64v4-g32", 76),  # K 32 + 2 x 2 metadata bytes, V 32 + 2 x 2 x 2
    ("kvtax-k4c64v4", "k4-c64v4", 72),      # V 32 + 2 x 2: int4's bytes
])
def test_c64_arm_runs_both_phases_and_counts_its_bytes(arm, spec, per_token, tmp_path,
                                                        monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run = run_benchmark("attention.py", "--dry-run", "--arms", arm, "kvtax-int4",
                        "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    (rows_file,) = tmp_path.glob("*/rows.jsonl")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    ours = [r for r in rows if r["arm"] == arm]
    assert {(r["phase"], r["ctx"]) for r in ours} == {(p, c) for p in ("decode", "prefill")
                                                      for c in (64, 96)}
    assert KVSpec.parse(spec).bytes_per_token(64) == per_token
    for r in ours:
        assert r["status"] == "ok", r["note"]
        q_bytes = 2 * r["batch"] * r["q_heads"] * r["rows"] * r["head_dim"] * 2
        assert r["bytes"] == per_token * r["batch"] * r["kv_heads"] * r["ctx"] + q_bytes
        int4 = next(x for x in rows if x["arm"] == "kvtax-int4" and x["phase"] == r["phase"]
                    and x["ctx"] == r["ctx"])
        # random (outlier-free) keys: both 4-bit formats land near the same error
        assert r["rel_err_vs_fp16"] < 1.5 * int4["rel_err_vs_fp16"]


def test_q4_arm_is_the_whole_hybrid_spec(tmp_path, monkeypatch):
    """`kvtax-q4`: fp16 sinks and recent ring plus the c64 body, through attention(); its
    bytes are the HybridCache's (body + fp16 part), its note the resolved spec."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run = run_benchmark("attention.py", "--dry-run", "--arms", "kvtax-q4", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    (rows_file,) = tmp_path.glob("*/rows.jsonl")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert {(r["phase"], r["ctx"]) for r in rows} == {(p, c) for p in ("decode", "prefill")
                                                      for c in (64, 96)}
    body = KVSpec.parse("k4-c64v4").bytes_per_token(64)
    for r in rows:
        assert r["status"] == "ok" and r["note"] == "k4-c64v4@s4r128", r["note"]
        q_bytes = 2 * r["batch"] * r["q_heads"] * r["rows"] * r["head_dim"] * 2
        fp16 = min(r["ctx"], 4 + 128) * 64 * 2 * 2  # every dry-run token is also in the ring
        assert r["bytes"] == r["batch"] * r["kv_heads"] * (body * r["ctx"] + fp16) + q_bytes
        # the dry-run contexts fit the fp16 window: the result is fp16's
        assert r["rel_err_vs_fp16"] < 1e-2
