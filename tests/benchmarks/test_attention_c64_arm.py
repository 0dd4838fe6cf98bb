"""benchmarks/attention.py's channel-block arms (`kvtax-int4c64`: K int4-c64, V int4-g32,
one plain view; `kvtax-k4c64v4`, q4's body: V int4; `kvtax-k3c64v3`, q3's body: K int3-c64,
V int3-g32) and whole hybrid specs (`kvtax-q4`, `kvtax-q3`) in a dry run on CPU (the
interpreter): both phases run, and the TB/s column's bytes are the format's."""

from __future__ import annotations

import json

import pytest

from kvtax.formats import KVSpec
from tests.support.scripts import run_benchmark

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("arm, spec, per_token, err", [
    ("kvtax-int4c64", "k4-c64v4-g32", 76, 1.5),  # K 32 + 2 x 2 metadata bytes, V 32 + 2 x 2 x 2
    ("kvtax-k4c64v4", "k4-c64v4", 72, 1.5),      # V 32 + 2 x 2: int4's bytes
    ("kvtax-k3c64v3", "k3-c64v3-g32", 60, 3.0),  # K 24 + 2 x 2, V 24 + 2 x 2 x 2
])
def test_c64_arm_runs_both_phases_and_counts_its_bytes(arm, spec, per_token, err, tmp_path,
                                                        monkeypatch):
    """err: the arm's error bound as a multiple of int4's (3-bit steps are 15/7 of 4-bit's)."""
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
        # random (outlier-free) keys: 4-bit formats land near int4's error, 3-bit ~2x
        assert r["rel_err_vs_fp16"] < err * int4["rel_err_vs_fp16"]


@pytest.mark.parametrize("arm, name, body, window", [
    ("kvtax-q4", "k4w-c64v4@s4r128", "k4w-c64v4", 4 + 128),
    ("kvtax-q3", "k3-c64v3-g32@s4r96", "k3-c64v3-g32", 4 + 96),
])
def test_hybrid_arm_is_the_whole_spec(arm, name, body, window, tmp_path, monkeypatch):
    """`kvtax-q4` / `kvtax-q3`: fp16 sinks and recent ring plus the c64 body, through
    attention(); its bytes are the HybridCache's (body + fp16 part), its note the resolved
    spec."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run = run_benchmark("attention.py", "--dry-run", "--arms", arm, "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    (rows_file,) = tmp_path.glob("*/rows.jsonl")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert {(r["phase"], r["ctx"]) for r in rows} == {(p, c) for p in ("decode", "prefill")
                                                      for c in (64, 96)}
    per_token = KVSpec.parse(body).bytes_per_token(64)
    for r in rows:
        assert r["status"] == "ok" and r["note"] == name, r["note"]
        q_bytes = 2 * r["batch"] * r["q_heads"] * r["rows"] * r["head_dim"] * 2
        fp16 = min(r["ctx"], window) * 64 * 2 * 2  # every dry-run token is also in the ring
        assert r["bytes"] == r["batch"] * r["kv_heads"] * (per_token * r["ctx"] + fp16) + q_bytes
        # the dry-run contexts fit the fp16 window: the result is fp16's
        assert r["rel_err_vs_fp16"] < 1e-2
