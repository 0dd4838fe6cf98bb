"""The hf-quantized arm (transformers' QuantizedCache through quanto) and the sweep's budget
rules: max_context and skip-after-failure rows, rep-by-rep order, a time budget that a
resume finishes without losing or repeating a cell."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

from kvtax.harness.bench.hf_quantized import hf_config, hf_quantized_unavailable
from kvtax.harness.bench.plan import SweepConfig, plan_cells
from kvtax.harness.schema import validate_row
from kvtax.harness.store import read_rows
from kvtax.harness.bench.sweep import run_sweep
from kvtax.models import CONFIG_NAMES, ModelConfig, Runner, get_config, load_model
from tests.support.tensors import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

HAS_QUANTO = importlib.util.find_spec("optimum") is not None and (
    importlib.util.find_spec("optimum.quanto") is not None
)
needs_quanto = pytest.mark.skipif(not HAS_QUANTO, reason="optimum-quanto is not installed")


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_hf_config_round_trips_every_builtin(name):
    """The transformers config made for a built-in reads back as the same ModelConfig."""
    cfg = get_config(name)
    back = ModelConfig.from_hf(hf_config(cfg).to_dict(), name=cfg.name)
    diff = {f.name: (getattr(cfg, f.name), getattr(back, f.name))
            for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(back, f.name)}
    assert not diff


@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3"])
def test_hf_model_from_builtin_config_computes_kvtax_decoder(name, tmp_path):
    """An HF model built from `hf_config`, saved and loaded by kvtax, gives the same logits:
    the hf-quantized arm runs the same model as every other arm."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(hf_config(get_config(name)), dtype=torch.float32)
    hf.eval().save_pretrained(tmp_path)
    ours = load_model(str(tmp_path))
    ids = torch.randint(0, 250, (1, 77))  # > gemma3-tiny's 64-token window
    runner = Runner(ours, kv="fp32", chunk_size=32)
    with torch.no_grad():
        want = hf(input_ids=ids).logits[:, -1]
        got = runner.prefill(ids, runner.make_caches())
    assert_close(got, want, atol=2e-4, rel_rms=1e-4, what=name)


def test_unavailable_reasons_name_the_cause():
    from kvtax.harness.bench.sweep import hf_quantized_unavailable as sweep_reason

    assert "whole-model" in sweep_reason("int4", "tiny", level="attention")
    if not HAS_QUANTO:
        assert "optimum-quanto" in hf_quantized_unavailable("int4")
        return
    assert hf_quantized_unavailable("int4", "tiny") is None
    assert hf_quantized_unavailable("int4-g32") is None
    assert "bits" in hf_quantized_unavailable("int8")
    assert "one integer format" in hf_quantized_unavailable("k8v4")
    assert "one integer format" in hf_quantized_unavailable("fp16")
    assert "sliding" in hf_quantized_unavailable("int4", "tiny-gemma3")


@needs_quanto
def test_hf_quantized_cell_measures_phases_on_cpu():
    from kvtax.harness.bench.worker import measure

    cfg = SweepConfig(model="tiny", contexts=[300], kvs=["int4"], paths=["hf-quantized"],
                      reps=1, warmup=0, decode_tokens=5, chunk_size=128)
    (cell,) = plan_cells(cfg)
    row = measure(dict(cell.to_dict(), run_id="t", device_name="cpu"))
    validate_row(row)
    assert row["status"] == "ok", row.get("traceback") or row.get("error")
    assert row["engine"] == "transformers" and "quanto" in row["hf_cache"]
    assert row["ttft_s"] > 0 and len(row["decode_ms_samples"]) == 5
    # Chunks of 128: the first is quantized as it arrives, the second flushes everything
    # (128 >= residual 128), the third (44 tokens) stays in the unquantized residual.
    assert row["prefill_growth_events"] == 2
    assert row["decode_growth"] is False  # 44 + 1 + 5 < 128: no flush inside the window
    cfg_m = get_config("tiny")
    fp32_per_token = 2 * cfg_m.num_kv_heads * cfg_m.head_dim * 4 * cfg_m.num_layers
    resident = row["cache_bytes"]
    assert 44 * fp32_per_token < resident < 300 * fp32_per_token / 2  # most of it quantized
    assert row["presized"] is False and row["quanto_unpack"]


def test_rounds_order_rep_by_rep():
    cfg = SweepConfig(level="attention", model="x", contexts=[16, 32], kvs=["fp16", "int8"],
                      paths=["fused"], reps=3, warmup=1, rounds=True)
    cells = plan_cells(cfg)
    reps = [c.rep for c in cells if not c.warmup]
    assert reps == sorted(reps) and len(set(reps)) == 3
    assert all(c.warmup for c in cells[:2])
    plain = plan_cells(dataclasses.replace(cfg, rounds=False))
    assert sorted(c.cell_id for c in plain) == sorted(c.cell_id for c in cells)


def test_budget_skips_and_breaker_then_resume_completes(tmp_path, monkeypatch):
    """max_context and an OOM become "skipped" rows, a zero budget runs nothing costly, and
    a resume finishes every planned cell exactly once."""
    cfg = SweepConfig(level="attention", model="attn-test", heads=4, kv_heads=2, head_dim=64,
                      contexts=[16, 32, 48], kvs=["fp16", "int8"],
                      paths=["fused", "unfused", "hf-quantized"], reps=2, warmup=0,
                      decode_tokens=2, max_context={"unfused": 32}, skip_after_failure=True,
                      rounds=True)
    monkeypatch.setenv("KVTAX_FORCE_OOM", "prefill:int8/fused|c32")
    say: list[str] = []
    store = run_sweep(cfg, out=str(tmp_path), print_fn=say.append, budget_s=0.0)
    rows = read_rows(store.path)
    assert {r["status"] for r in rows} <= {"skipped", "unavailable"}
    assert any("time budget" in s and "--resume" in s for s in say)
    store = run_sweep(cfg, resume=str(store.path), print_fn=say.append)
    rows = read_rows(store.path)
    planned = [c.cell_id for c in plan_cells(cfg)]
    assert sorted(r["cell_id"] for r in rows) == sorted(planned)
    for r in rows:
        validate_row(r)
    by = {(r["arm"], r["context"], r["rep"]): r for r in rows}
    assert all(by["int8/unfused", 48, k]["status"] == "skipped" for k in (0, 1))
    assert "max_context" in by["int8/unfused", 48, 0]["error"]
    assert all(by["int8/hf-quantized", c, k]["status"] == "unavailable"
               for c in (16, 32, 48) for k in (0, 1))
    # The first int8/fused cell at 32 ran out of memory (forced); after it, that arm's
    # cells at 32 and above were not retried; other arms and smaller contexts ran normally.
    at32 = sorted((by["int8/fused", 32, k] for k in (0, 1)), key=lambda r: r["seq"])
    assert at32[0]["status"] == "oom" and at32[1]["status"] == "skipped"
    assert "skip_after_failure" in at32[1]["error"]
    for k in (0, 1):
        r = by["int8/fused", 48, k]
        assert r["status"] == ("skipped" if r["seq"] > at32[0]["seq"] else "ok"), r
    assert all(by[a, c, k]["status"] == "ok" for a in ("fp16/fused", "int8/unfused")
               for c in (16, 32) for k in (0, 1))
    assert all(by["int8/fused", 16, k]["status"] == "ok" for k in (0, 1))
    env = json.loads((store.path / "env.json").read_text())
    assert len(env["previous"]) == 1


@pytest.mark.parametrize("bits", [2, 4])
def test_torch_unpack_fallback_matches_quanto_layout(bits):
    """The no-nvcc fallback unpacks like quanto: value i of byte j lands at row i*n + j."""
    from kvtax.harness.bench.hf_quantized import _torch_unpack

    packed = torch.randint(0, 256, (37, 5), dtype=torch.uint8)
    got = _torch_unpack(packed, bits)
    per = 8 // bits
    assert got.shape == (37 * per, 5) and got.dtype == torch.uint8
    for i in range(per):
        want = (packed.to(torch.int32) >> (bits * i)) & (2**bits - 1)
        assert torch.equal(got[i * 37:(i + 1) * 37].to(torch.int32), want)
    if HAS_QUANTO:
        import optimum.quanto  # noqa: F401 - registers torch.ops.quanto

        assert torch.equal(got, torch.ops.quanto.unpack(packed, bits))
