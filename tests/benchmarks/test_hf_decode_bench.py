"""Smoke test of benchmarks/hf_decode.py: a toy model on the CPU (the H200 run is the lead's)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import torch

from kvtax.formats import KVSpec
from kvtax.hf.models import tiny_config

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "hf_decode.py"


def _load():
    spec = importlib.util.spec_from_file_location("hf_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_cpu_run_writes_rows_and_table(tmp_path, capsys) -> None:
    bench = _load()
    out = tmp_path / "run"
    rows = bench.main(
        [
            "--device",
            "cpu",
            "--config",
            "tiny",
            "--context",
            "64",
            "--new-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    by = {(r["arm"], r["mode"]): r for r in rows}
    assert set(by) == {(a, m) for a in bench.ARMS for m in ("eager", "static")}
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

    saved = json.loads((out / "rows.json").read_text())
    assert len(saved["rows"]) == len(rows) and saved["environment"]["torch"] == torch.__version__
    table = (out / "table.md").read_text().strip()
    assert capsys.readouterr().out.strip().endswith(table)
    assert table.count("\n") == len(rows) + 1  # header, rule, one line per row
