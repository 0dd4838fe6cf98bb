"""Programmatic dependent launch (kvtax.pdl): when it is on, and (GPU) that it changes no bit.

The kernels' PDL variants only add `griddepcontrol` instructions and L2 prefetches of
read-only weights, so a decode step must give bit-identical logits with PDL on and off;
a kernel that read its predecessor's output before `pdl_wait` would not (a race shows
as differing logits). The interpreter never runs them: CI checks the switch, the GPU
run checks the kernels (compiled for sm_90 offline by `compile_check.py --pdl`).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from kvtax import pdl
from kvtax.models import Runner, random_model
from kvtax.models.config import get_config


@pytest.fixture(autouse=True)
def _default_switch(monkeypatch):
    monkeypatch.delenv("KVTAX_PDL", raising=False)
    yield
    pdl.set_enabled(None)


def test_off_for_cpu_and_the_interpreter() -> None:
    assert not pdl.enabled(torch.device("cpu"))
    # decided before any CUDA query, so this holds on a machine without CUDA too
    assert not pdl.enabled(torch.device("cuda"), interpreting=True)


@pytest.mark.parametrize("how", ["env", "call"])
def test_switched_off(monkeypatch, how: str) -> None:
    if how == "env":
        monkeypatch.setenv("KVTAX_PDL", "0")
    else:
        pdl.set_enabled(False)
    assert not pdl.enabled(torch.device("cuda"))  # off before the device is looked at


def test_a_bad_environment_value_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv("KVTAX_PDL", "maybe")
    with pytest.raises(ValueError, match="KVTAX_PDL"):
        pdl.enabled(torch.device("cuda"))


def test_decode_benchmark_parses_pdl_lists() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import decode

    assert decode.parse_pdl("on, off") == [True, False]
    with pytest.raises(SystemExit, match="on / off"):
        decode.parse_pdl("yes")


def _logits(model, kv: str, on: bool, steps: int = 12) -> torch.Tensor:  # noqa: ANN001
    """Prefill 700 random tokens, then `steps` greedy CUDA-graph decode steps with PDL
    `on`; the steps' logits `[steps, vocab]`."""
    pdl.set_enabled(on)
    runner = Runner(model, kv=kv, chunk_size=256)
    caches = runner.make_caches(capacity=700 + steps + 2)
    gen = torch.Generator(device="cuda").manual_seed(5)
    prompt = torch.randint(0, model.config.vocab_size, (1, 700), device="cuda", generator=gen)
    try:
        tok = runner.prefill(prompt, caches).argmax(-1, keepdim=True)
        out = []
        for _ in range(steps):
            logits = runner.decode_step(tok, caches)
            out.append(logits.clone())
            tok = logits.argmax(-1, keepdim=True)
        assert runner._graph is not None, runner.graph_disabled_reason
        assert runner.fused_gemv
        return torch.cat(out)
    finally:
        runner.release_graph()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv", ["bf16", "int8", "int4"])
def test_graph_decode_logits_are_identical_with_and_without_pdl(kv: str) -> None:
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("this GPU has no programmatic dependent launch (sm_90+)")
    # Llama-3.1-8B's layer shapes, so the GEMVs and attention run their real grids
    cfg = dataclasses.replace(get_config("llama-3.1-8b"), num_layers=2, vocab_size=32768)
    model = random_model(cfg, dtype=torch.bfloat16, device="cuda", seed=1)
    on = _logits(model, kv, True)
    off = _logits(model, kv, False)
    assert torch.isfinite(on).all()
    assert torch.equal(on, off)
