"""benchmarks/attention.py --introspect (dry run on CPU, the interpreter): each kvtax decode
row carries where its tensors lie, the Triton variants compiled so far and the clocks."""

from __future__ import annotations

import json

import pytest

from tests.support.scripts import run_benchmark

pytestmark = pytest.mark.kernels


def test_decode_rows_say_what_the_cell_ran_with(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run = run_benchmark("attention.py", "--dry-run", "--introspect", "--phases", "decode",
                        "--arms", "kvtax-int8", "sdpa-flash", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    (rows_file,) = tmp_path.glob("*/rows.jsonl")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    ours = [r for r in rows if r["arm"] == "kvtax-int8"]
    assert ours and all(r["status"] == "ok" for r in ours)
    for r in ours:
        where = r["introspect"]["placement"]
        assert {"q", "lengths", "k.codes", "k.scales", "v.codes"} <= set(where)
        k = where["k.codes"]
        assert 0 <= k["mod_64k"] < 64 << 10 and k["mod_2m"] % (64 << 10) == k["mod_64k"]
        assert k["nbytes"] > 0 and "variants" in r["introspect"]
    assert all("introspect" not in r for r in rows if r["arm"] == "sdpa-flash")


def test_decode_history_times_each_stage_with_its_record(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run = run_benchmark("decode_history.py", "--dry-run", "--formats", "int8",
                        "--history-arms", "unfused-int8", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    (rows_file,) = tmp_path.glob("*/rows.jsonl")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    stages = [r["stage"] for r in rows]
    assert stages == ["fresh", "history", "history", "same", "realloc", "realloc+ec"]
    assert all(r["status"] == "ok" for r in rows if r["stage"] == "history")
    timed = [r for r in rows if r["stage"] != "history"]
    assert all(r["median_ms"] > 0 and "k.codes" in r["placement"] for r in timed)
    # `same` reads the very tensors `fresh` did; a reallocation is a new tensor.
    where = {r["stage"]: r["placement"]["k.codes"] for r in timed}
    assert where["same"] == where["fresh"]
