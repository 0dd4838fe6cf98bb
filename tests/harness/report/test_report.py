"""`write_report` on synthetic rows written in the schema: sections, planted numbers,
flagged cells named, figures written, and the two-run comparison."""

from __future__ import annotations

import json
import random
import re

import pytest

from kvtax.cli import main as cli_main
from kvtax.harness.report.write import write_report
from kvtax.harness.schema import base_row, make_cell_id, validate_row
from kvtax.harness.store import RunStore

CONTEXTS = [1024, 2048, 4096, 8192, 16384]
# Planted decode slopes (ms per token per context token): fp16 / int8 = 1.9, fp16 / int4 = 3.5.
SLOPE = {"fp16": 1.0e-3, "int8": 1.0e-3 / 1.9, "int4": 1.0e-3 / 3.5}
T0 = {"fp16": 20.0, "int8": 20.5, "int4": 20.8}
BPT = {"fp16": 4096, "int8": 2176, "int4": 1152}   # predicted int8 ratio 1.882, int4 3.556
TTFT_X = {"fp16": 1.0, "int8": 1.5, "int4": 2.0}    # prefill slowdown vs fp16
NOISY = ("int4", 16384)                             # a published mlx-lm sweep's one noisy cell
CLAIMS = [
    {"metric": "slope_ratio", "arm": "int8", "range": [1.8, 2.0]},
    {"metric": "slope_ratio", "arm": "int4", "range": [3.8, 4.2]},
    {"metric": "prefill_peak_le_fp16", "arm": "int4"},
]


def _cell(kv: str, ctx: int, rep: int, seq: int, kind: str = "bench", **extra) -> dict:
    params = {"kind": kind, "model": "tiny", "arm": f"{kv}/fused", "context": ctx, "rep": rep,
              "warmup": False, **extra}
    return {"cell_id": make_cell_id(params), "seq": seq, "order_seed": 7, "kv": kv,
            "path": "fused", **params}


def synthetic_rows(run_id: str, speed: float = 1.0, seed: int = 0) -> list[dict]:
    """Bench rows with planted slopes (decode time x `speed`), one noisy cell, one OOM,
    a warm-up row, and recall rows (fp16 4/4, int4 3/4 at 1024)."""
    rng = random.Random(seed)
    rows, seq = [], 0
    for kv in ("fp16", "int8", "int4"):
        for ctx in CONTEXTS + [32768]:
            for rep in range(-1, 5):
                cell = _cell(kv, ctx, max(rep, 0), seq, warmup=rep < 0)
                cell["warmup"] = rep < 0
                seq += 1
                row = base_row(cell, run_id=run_id, device="cpu", git_commit="abc123")
                if ctx == 32768:
                    if kv != "int4" or rep != 0:
                        continue
                    row.update(status="oom", phase="prefill", error="CUDA out of memory. Tried "
                               "to allocate 8.00 GiB")
                    rows.append(row)
                    continue
                ms = (T0[kv] + SLOPE[kv] * ctx) * speed * (1 + rng.uniform(-0.003, 0.003))
                if (kv, ctx) == NOISY:
                    ms *= [1.0, 1.6, 0.7, 1.45, 1.3, 0.8][rep + 1]
                if rep < 0:
                    ms *= 3  # warm-up: cold caches; must not reach any statistic
                ttft = ctx / 5000 * TTFT_X[kv] * (1 + rng.uniform(-0.003, 0.003))
                row.update(
                    status="ok", ttft_s=ttft, prefill_tok_s=ctx / ttft,
                    # int4's prefill carries a transient (mlx-lm's prefill inversion); decode does not.
                    prefill_peak_bytes=int(1e9 + ctx * BPT[kv]
                                           + (ctx * 8192 if kv == "int4" else 0)),
                    decode_ms_per_token=ms, decode_ms_samples=[ms] * 4,
                    decode_peak_bytes=int(1e9 + ctx * BPT[kv]), decode_growth=ctx == 2048,
                    cache_bytes=ctx * BPT[kv], bytes_per_token=BPT[kv],
                    cuda_graph=kv == "fp16",
                )
                rows.append(row)
    for kv, right in (("fp16", 4), ("int4", 3)):
        for q in range(4):
            cell = _cell(kv, 1024, 0, seq, kind="recall", fact_index=q)
            seq += 1
            row = base_row(cell, run_id=run_id, device="cpu", git_commit="abc123")
            row.update(status="ok", fact_index=q, depth=q / 3, expected="4,182",
                       answer="4,182 copper coins" if q < right else "4,183", correct=q < right)
            rows.append(row)
    cell = _cell("int8", 4096, 0, seq, kind="roofline", op="attention")
    row = base_row(cell, run_id=run_id, device="cpu", git_commit="abc123")
    row.update(status="ok", op="attention", time_s=2e-4, bytes_moved=180_000_000, flops=4e9,
               achieved_gbs=900.0, achieved_tflops=20.0, peak_gbs=1000.0, peak_tflops=800.0,
               bandwidth_fraction=0.9, compute_headroom=40.0)
    rows.append(row)
    for r in rows:
        validate_row(r)
    return rows


def make_run(root, name: str, **kw) -> RunStore:
    store = RunStore.create(root, name, {"command": f"kvtax bench --name {name}",
                                         "cv_threshold": 0.10, "claims": CLAIMS})
    store.write_env({"device": "Synthetic GPU", "torch": "2.13", "git_commit": "abc123",
                     "timestamp": "2026-11-29T00:00:00Z"})
    for r in synthetic_rows(store.run_id, **kw):
        store.append(r)
    return store


def _table_row(md: str, first_cell: str, after: str) -> list[str]:
    """Cells of the first table row starting with `first_cell` after heading `after`."""
    body = md[md.index(after):]
    for line in body.splitlines():
        if line.startswith(f"| {first_cell} |"):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no row {first_cell!r} after {after!r}")


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("runs"), "a")


def test_report_sections_numbers_and_figures(run_a):
    pytest.importorskip("matplotlib")
    out = write_report(run_a.path, price_per_hour=3.6)
    md = out.read_text()
    for heading in ("## Decode", "## Flagged cells", "## Prefill", "## Memory per phase",
                    "## Cost per million", "## Recall", "## Roofline",
                    "## Cells that did not complete", "## Claims", "## Environment"):
        assert heading in md, heading
    assert "kvtax bench --name a" in md, "the exact command is shown"
    # Fit table: planted slope ratios recovered; the noisy int4 cell excluded from its fit.
    fit_int8 = _table_row(md, "int8/fused", "Fit `ms_per_token")
    assert abs(float(fit_int8[6]) - 1.9) < 0.03 and fit_int8[7] == "1.88"
    fit_int4 = _table_row(md, "int4/fused", "Fit `ms_per_token")
    assert fit_int4[5] == "16384", "the flagged context is named in the fit's exclusions"
    assert abs(float(fit_int4[6]) - 3.5) < 0.1
    assert float(fit_int4[9]) < 2.5, "kept in, the noisy cell would have changed the conclusion"
    # The noisy cell is named, with its CV; warm-up rows (3x slower) never reach a median.
    assert re.search(
        r"\*\*int4/fused @ 16384\*\* \(decode_ms_per_token\): robust CV 0\.\d+ > 0\.10", md)
    fp16_dec = _table_row(md, "fp16/fused", "## Decode")
    assert fp16_dec[-1] == "captured" and _table_row(md, "int8/fused", "## Decode")[-1] == \
        "eager", "each arm says whether its decode replayed a CUDA graph"
    assert abs(float(fp16_dec[1].split()[0]) - (20 + 1.024)) < 0.2
    # Break-even at 16384 for int8: (1.5 - 1) * ttft / (ms saved per token).
    ttft = 16384 / 5000
    saved = (T0["fp16"] + SLOPE["fp16"] * 16384) - (T0["int8"] + SLOPE["int8"] * 16384)
    expect = 0.5 * ttft / (saved / 1000)
    be = _table_row(md, "int8/fused", "Break-even")
    assert abs(float(be[5].replace(",", "")) - expect) / expect < 0.05
    assert _table_row(md, "int8/fused", "Break-even")[1] == "never", \
        "at 1024 int8 decodes slower (higher t0): a slower prefill never pays back"
    assert _table_row(md, "int4/fused", "Break-even")[5].endswith("*"), "rests on the noisy cell"
    # Cost: $3.60/h is $1 per million tokens per ms/token.
    cost = _table_row(md, "fp16/fused", "## Cost per million")
    assert abs(float(cost[1].strip("$")) - (20 + 1.024)) < 0.2
    assert _table_row(md, "fp16/fused", "## Recall")[1:] == ["4/4"]
    assert _table_row(md, "int4/fused", "## Recall")[1:] == ["3/4"]
    assert _table_row(md, "int4/fused", "By fact")[1:] == ["1/1", "1/1", "1/1", "0/1"]
    assert "'4,183'" in md, "wrong answers are listed for spot-checking"
    assert "oom" in _table_row(md, "bench", "## Cells that did not complete")
    assert "CUDA out of memory" in md
    assert _table_row(md, "attention", "## Roofline")[4:6] == ["900", "0.900"]
    claims = md[md.index("## Claims"):]
    assert "int8/fused slope_ratio in [1.8, 2.0] | HELD" in claims
    assert "int4/fused slope_ratio in [3.8, 4.2] | FAILED" in claims
    assert "int4/fused prefill peak <= fp16 prefill peak at every context | FAILED" in claims
    memory = md[md.index("## Memory per phase"):]
    assert re.search(r"\| fp16/fused \| 2048 \|.*\| grew \|", memory)
    assert not re.search(r"\| fp16/fused \| 4096 \|.*grew", memory)
    for name in ("decode", "memory", "ttft", "recall"):
        png = run_a.path / "figures" / f"{name}.png"
        assert png.exists() and png.stat().st_size > 1000, name
        assert f"figures/{name}.png" in md
    data = json.loads((run_a.path / "analysis.json").read_text())
    assert data["flagged"][0]["arm"] == "int4/fused" and data["recall"]["grid"]


def test_compare_two_runs(tmp_path, run_a):
    pytest.importorskip("matplotlib")
    run_b = make_run(tmp_path, "b", speed=0.5, seed=1)
    out = write_report(run_a.path, compare=run_b.path)
    assert out.name == f"compare-{run_b.run_id}.md"
    md = out.read_text()
    assert f"A = {run_a.run_id}, B = {run_b.run_id}" in md
    dec = _table_row(md, "int8/fused", "## decode_ms_per_token")  # [arm, ctx 1024, ...]
    assert len(dec) == 1 + len(CONTEXTS)
    assert all(abs(float(c.split()[0]) - 0.5) < 0.01 for c in dec[1:]), "B decodes 2x as fast"
    assert _table_row(md, "int8/fused", "## cache_bytes")[1] == "1.00 (2.12 MiB → 2.12 MiB)"
    assert _table_row(md, "fp16/fused", "## recall_accuracy")[1] == "1.00 (4/4 → 4/4)"
    assert re.search(r"- \*\*A\*\* \(best fp16 arm fp16/fused\): On Synthetic GPU with tiny, "
                     r"quantized KV", md), "each run's verdict, first sentence"
    m_ratio = _table_row(md, "fp16/fused", "## Decode fits")[5]
    assert abs(float(m_ratio) - 0.5) < 0.02
    assert (run_a.path / "figures" / f"compare-{run_b.run_id}-decode_ms_per_token.png").exists()


def test_cli_report_and_bad_folder(tmp_path, run_a, capsys):
    assert cli_main(["report", str(run_a.path)]) == 0
    assert "report.md" in capsys.readouterr().out
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_report_without_matplotlib(tmp_path, monkeypatch):
    """No matplotlib: the markdown is still written, and says why there are no figures."""
    from kvtax.harness.report import plots as report_plots

    monkeypatch.setattr(report_plots, "plotting_unavailable", lambda: "matplotlib is not "
                        "installed (pip install 'kvtax[report]'); figures skipped")
    run = make_run(tmp_path, "nomp")
    md = write_report(run.path).read_text()
    assert "matplotlib is not installed" in md and "## Decode" in md
    assert not (run.path / "figures").exists()


def test_failures_are_one_row_per_arm_and_reason_and_the_arms_are_explained():
    from kvtax.harness.report.markdown import section_arms, section_failures

    capped = [dict(kind="bench", arm="fp8/unfused", context=c, rep=r, status="skipped",
                   phase=None, error=f"skipped: context {c} is above max_context 1 for fp8/unfused")
              for c in (4096, 16384) for r in (0, 1, 2)]
    oom = dict(kind="bench", arm="int8/fused", context=16384, rep=0, status="oom",
               phase="prefill", error="Traceback\ntorch.OutOfMemoryError: CUDA out of memory")
    md = "\n".join(section_failures(capped + [oom]))
    assert _table_row(md, "bench", "## Cells") == [
        "bench", "fp8/unfused", "4096, 16384", "6", "skipped", "-",
        "skipped: context <ctx> is above max_context 1 for fp8/unfused"]
    assert md.count("| bench |") == 2 and "| int8/fused | 16384 | 1 | oom | prefill |" in md
    legend = "\n".join(section_arms(["fp16/fp16", "int8/fused", "int8/unfused"]))
    assert "`unfused`" in legend and "quantized_matmul" in legend and "`dequant`" not in legend
    assert section_arms(["f16/fa", "q8_0/nofa"]) == [], "another engine's paths: none of these"
