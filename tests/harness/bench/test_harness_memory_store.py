"""Per-phase peak memory, run folders, torn-line tolerance, planning and the row schema."""

from __future__ import annotations

import json
import mmap

import pytest

import torch

from kvtax.errors import FormatError
from kvtax.harness.bench import memory
from kvtax.harness.bench.plan import SweepConfig, plan_cells, resolve_kv
from kvtax.harness.schema import SchemaError, base_row, make_cell_id, validate_row
from kvtax.harness.store import RunFolderError, RunStore, read_rows

MB = 1 << 20
needs_clear_refs = pytest.mark.skipif(
    not memory.cpu_peak_supported(), reason="needs Linux /proc/self/clear_refs"
)


@needs_clear_refs
def test_cpu_peak_resets_per_phase():
    """A phase that touches 200 MiB reads >= 200 MB above its start; the next phase, which
    allocates nothing, reads far less — the whole-run peak does not leak into it.

    (200 MiB is 209.7 MB: the slack covers pages the process frees during the phase, e.g.
    by garbage collection, which lower RSS while the tensor raises it.)"""
    meter = memory.PhaseMeter("cpu")
    with meter.phase("big"):
        # 200 MiB of fresh anonymous pages, each written: resident whatever the allocator
        # already holds (freed heap memory that earlier tests left would be reused unseen)
        x = mmap.mmap(-1, 200 * MB)
        x[::4096] = b"\1" * len(range(0, 200 * MB, 4096))
        x.close()
    with meter.phase("small"):
        y = torch.ones(1000)
        del y
    big = meter.peaks["big"] - meter.baselines["big"]
    small = meter.peaks["small"] - meter.baselines["small"]
    assert big >= 200_000_000, big
    assert small < 20 * MB, small
    assert meter.peaks["small"] < meter.peaks["big"] - 150 * MB


def test_meter_reports_none_where_unmeasurable(monkeypatch):
    monkeypatch.setattr(memory, "cpu_peak_supported", lambda: False)
    meter = memory.PhaseMeter("cpu")
    with meter.phase("p"):
        pass
    assert meter.peaks["p"] is None and meter.kind is None


def test_run_folders_are_never_reused(tmp_path):
    a = RunStore.create(tmp_path, "x", {"k": 1})
    b = RunStore.create(tmp_path, "x", {"k": 2})
    assert a.path != b.path
    assert json.loads((a.path / "config.json").read_text())["k"] == 1
    assert json.loads((b.path / "config.json").read_text())["run_id"] == b.run_id


def test_torn_last_line_is_skipped_then_cut_on_reopen(tmp_path):
    store = RunStore.create(tmp_path, "torn", {})
    store.append({"cell_id": "a", "v": 1})
    store.append({"cell_id": "b", "v": float("nan")})
    with open(store.rows_path, "a") as f:
        f.write('{"cell_id": "c", "v":')  # a writer killed mid-line
    assert [r["cell_id"] for r in read_rows(store.path)] == ["a", "b"]
    assert read_rows(store.path)[1]["v"] is None  # NaN stored as null, JSON stays valid
    reopened = RunStore.open(store.path)
    reopened.append({"cell_id": "d"})
    lines = store.rows_path.read_text().splitlines()
    assert [json.loads(x)["cell_id"] for x in lines] == ["a", "b", "d"]
    assert reopened.done_cell_ids() == {"a", "b", "d"}


def test_open_refuses_a_non_run_folder(tmp_path):
    with pytest.raises(RunFolderError, match="not a run folder"):
        RunStore.open(tmp_path)
    with pytest.raises(RunFolderError, match="does not exist"):
        RunStore.open(tmp_path / "missing")


@pytest.mark.parametrize("config, want", [
    ({}, "is empty"),
    ({"model": "tiny", "contexts": [8]}, "names no run kind"),
    ({"kind": "quality", "contexts": [8]}, "is a kvtax quality run, not a bench run"),
    ({"kind": "bench", "run_schema": 99, "contexts": [8]}, "run schema 99"),
    ({"kind": "bench"}, "lacks contexts"),
], ids=["empty", "no-kind", "foreign-kind", "newer-schema", "missing-field"])
def test_open_for_resume_refuses_other_runs(tmp_path, config, want):
    """--resume once appended bench rows to a quality run and ran defaults over a {} config."""
    store = RunStore.create(tmp_path, "r", {})
    (store.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RunFolderError, match=want):
        RunStore.open(store.path, kind="bench", required=("contexts",))


def test_open_for_resume_accepts_its_own_and_older_runs(tmp_path):
    store = RunStore.create(tmp_path, "r", {"kind": "bench", "contexts": [8]})
    assert RunStore.open(store.path, kind="bench", required=("contexts",)).path == store.path
    old = {"kind": "bench", "contexts": [8]}  # written before config.json had run_schema
    (store.path / "config.json").write_text(json.dumps(old))
    assert RunStore.open(store.path, kind="bench", required=("contexts",)).path == store.path


def test_plan_is_seeded_interleaved_and_warmups_first():
    cfg = SweepConfig(contexts=[64, 128, 256], kvs=["fp16", "int8"], paths=["fused", "unfused"],
                      reps=3, warmup=1, seed=7)
    cells = plan_cells(cfg)
    again = plan_cells(cfg)
    assert [c.cell_id for c in cells] == [c.cell_id for c in again]
    assert len({c.cell_id for c in cells}) == len(cells)
    arms = {c.arm for c in cells}
    assert arms == {"fp16/fused", "int8/fused", "int8/unfused"}  # no unfused fp16 baseline
    n_warm = sum(c.warmup for c in cells)
    assert n_warm == 3 and all(c.warmup for c in cells[:n_warm])
    assert [c.seq for c in cells] == list(range(len(cells)))
    meas = [c.arm for c in cells[n_warm:]]
    assert meas != sorted(meas)  # interleaved, not arm after arm
    other = plan_cells(SweepConfig(**{**cfg.to_dict(), "seed": 8}))
    assert [c.cell_id for c in other] != [c.cell_id for c in cells]
    assert {c.cell_id for c in other} != {c.cell_id for c in cells}  # the seed is a param


def test_resolve_kv_adapts_default_group_only():
    assert resolve_kv("int8", 32).name == "int8-g32"
    assert resolve_kv("k8v4", 32).name == "k8-g32v4-g32"
    assert resolve_kv("int4", 128).name == "int4"
    assert resolve_kv("int4-g128", 64).name == "int4"  # wider than the row: one group
    with pytest.raises(FormatError, match="--kv int4-g64"):
        resolve_kv("int4-g64", 96)


def test_schema_base_row_and_validation():
    cell = plan_cells(SweepConfig(contexts=[64], kvs=["int8"], paths=["fused"], reps=1,
                                  warmup=0))[0].to_dict()
    row = base_row(cell, run_id="r", device="cpu", git_commit=None)
    with pytest.raises(SchemaError, match="error"):
        validate_row(row)  # a failed row must say why
    row.update(status="oom", phase="prefill", error="out of memory")
    validate_row(row)
    ok = dict(row, status="ok", error=None, phase=None, ttft_s=0.1, prefill_tok_s=640.0,
              prefill_peak_bytes=1, decode_ms_per_token=1.0, decode_ms_samples=[1.0],
              decode_peak_bytes=1, decode_growth=False, cache_bytes=10, bytes_per_token=2,
              clocks_start=None, clocks_end=None)
    validate_row(ok)
    with pytest.raises(SchemaError, match="ttft_s"):
        validate_row(dict(ok, ttft_s="fast"))
    with pytest.raises(SchemaError, match="rep"):
        validate_row(dict(ok, rep=True))
    assert make_cell_id({"a": 1, "b": 2}) == make_cell_id({"b": 2, "a": 1})
