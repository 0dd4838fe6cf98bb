"""Smoke test of benchmarks/hf_decode.py run as a script: a toy model on the CPU."""

from __future__ import annotations

import json

import torch

from kvtax.formats import KVSpec
from kvtax.hf.models import tiny_config
from tests.support.scripts import run_benchmark

ARMS = ("dynamic", "kvtax-int8", "kvtax-int4", "quanto-int4")


def test_tiny_cpu_run_writes_rows_and_table(tmp_path) -> None:
    out = tmp_path / "run"
    run = run_benchmark("hf_decode.py", "--device", "cpu", "--config", "tiny", "--context",
                        "64", "--new-tokens", "4", "--out", str(out))
    assert run.returncode == 0, run.stderr
    saved = json.loads((out / "rows.json").read_text())
    rows = saved["rows"]
    by = {(r["arm"], r["mode"]): r for r in rows}
    assert set(by) == {(a, m) for a in ARMS for m in ("eager", "static")}
    for arm in ("dynamic", "kvtax-int8", "kvtax-int4"):
        for mode in ("eager", "static"):
            r = by[arm, mode]
            assert r["status"] == "ok", (arm, mode, r.get("error"), r.get("traceback"))
            assert r["generated"] == 4 and r["ttft_s"] > 0 and r["decode_tok_s"] > 0
    quanto = by["quanto-int4", "eager"]["status"]
    assert quanto == "ok" or quanto.startswith("unavailable")  # optimum-quanto is optional
    assert by["quanto-int4", "static"]["status"].startswith("skipped")

    # A preallocated kvtax cache holds context + new + 1 slots per layer, allocated rounded
    # up to storage.ALIGN (aligned scale strides for the kernels' loads).
    from kvtax.cache.storage import ALIGN, round_up

    cfg = tiny_config("llama", vocab=1024)
    slots = round_up(64 + 4 + 1, ALIGN)
    for kv in ("int8", "int4"):
        per = KVSpec.parse(kv).bytes_per_token(cfg.head_dim, torch.bfloat16)
        want = per * slots * cfg.num_key_value_heads * cfg.num_hidden_layers
        assert by[f"kvtax-{kv}", "static"]["cache_bytes"] == want

    assert saved["environment"]["torch"] == torch.__version__
    table = (out / "table.md").read_text().strip()
    assert run.stdout.strip().endswith(table)
    assert table.count("\n") == len(rows) + 1  # header, rule, one line per row


def test_budget_skips_rows_and_every_row_lands_in_jsonl(tmp_path) -> None:
    """A row the budget cannot fit says so; every row is in rows.jsonl as it completes; a
    new run starts the file afresh; --table prints a killed run's rows."""
    out = tmp_path / "run"
    common = ("--device", "cpu", "--config", "tiny", "--context", "24", "--new-tokens", "3",
              "--modes", "eager", "--warmup-tokens", "2", "--out", str(out))
    run = run_benchmark("hf_decode.py", *common, "--arms", "dynamic,kvtax-int8",
                        "--budget-s", "1e-9")
    assert run.returncode == 0, run.stderr
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["arm"] for r in rows] == ["dynamic", "kvtax-int8"]
    assert [r["status"].split(":")[0] for r in rows] == ["skipped", "skipped"]
    run = run_benchmark("hf_decode.py", *common, "--arms", "dynamic")
    assert run.returncode == 0, run.stderr
    (row,) = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert row["status"] == "ok" and row["warmup_tokens"] == 3  # min(new, max(4, 2))
    assert row["generated"] == 3
    table = run_benchmark("hf_decode.py", "--table", str(out / "rows.jsonl"))
    assert "| dynamic | eager | ok |" in table.stdout
