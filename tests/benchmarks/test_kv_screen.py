"""Smoke test of benchmarks/kv_screen.py run as a script on the tiny random model: the fake
quantization must order schemes by their bits and the hooks (post- and pre-RoPE) must act."""

from __future__ import annotations

import json

from tests.support.scripts import run_benchmark

SCHEMES = ["k8g64/v8g64", "int4", "k2g64/v2g64", "k8c32+pre/v8g32", "k4c32+pre/v4g32",
           "k4c32/v4g32", "k4c32/v4g32@s4r64"]


def test_tiny_screen_orders_bits_and_writes_rows(tmp_path) -> None:
    out = tmp_path / "screen"
    run = run_benchmark("kv_screen.py", "--model", "tiny", "--contexts", "320",
                        "--tail", "64", "--threads", "1", "--schemes", ",".join(SCHEMES),
                        "--out", str(out))
    assert run.returncode == 0, run.stderr
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["scheme"] for r in rows] == ["fp16", *SCHEMES]
    by = {r["scheme"]: r for r in rows}
    kl = {s: by[s]["kl"] for s in SCHEMES}
    assert kl["k8g64/v8g64"] < 0.02 * kl["int4"] and kl["int4"] < kl["k2g64/v2g64"]
    assert kl["k8c32+pre/v8g32"] < 0.02 * kl["k4c32+pre/v4g32"]
    # +pre quantizes before RoPE: a different cache from post-RoPE, so different numbers.
    assert kl["k4c32+pre/v4g32"] != kl["k4c32/v4g32"]
    # The fp16 window keeps the last 64 + 64 positions exact: less error than none.
    assert kl["k4c32/v4g32@s4r64"] < kl["k4c32/v4g32"]
    assert by["k8g64/v8g64"]["worst_err"] < by["int4"]["worst_err"] < by["k2g64/v2g64"]["worst_err"]
    for r in rows:
        assert len(r["layer_attn_rel_err"]) == 2 and r["tail"] == 64 and r["context"] == 320
    assert by["int4"]["bytes_ratio"] == 0.28125 and by["fp16"]["bytes_ratio"] == 1.0
    table = (out / "table.md").read_text().strip()
    assert table.count("\n") == len(SCHEMES) + 1 and run.stdout.strip().endswith(table)
    assert "kv_screen.py" in (out / "command.txt").read_text()


def test_bad_input_exits_2_with_one_line() -> None:
    for args in (["--schemes", "k4x3/v4g32"], ["--contexts", "100", "--tail", "128"]):
        run = run_benchmark("kv_screen.py", "--model", "tiny", *args)
        assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
