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
