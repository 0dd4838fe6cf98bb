"""kvtax.pdl: programmatic dependent launch switches, and the placement each decode
attention launch asks for (CPU: the launch keywords only; tests/test_pdl_gpu.py runs the
kernels under PDL on an sm_90+ GPU)."""

from __future__ import annotations

import pytest
import torch

from kvtax import pdl
from kvtax.attention import launch as attn_launch
from kvtax.attention import triton_api as ta
from tests.support import kernels as ke

pytestmark = pytest.mark.kernels


def test_pdl_is_off_on_cpu_and_names_unknown_families() -> None:
    x = torch.zeros(2)
    assert pdl.launch_options("attention", x, interpreting=False) == {}
    assert not pdl.enabled("gemv", x, interpreting=True)
    with pytest.raises(ValueError, match="unknown PDL kernel family 'attn'"):
        pdl.enabled("attn", x, interpreting=False)


def test_pdl_launch_options_when_built(monkeypatch) -> None:
    """Where PDL is built (enabled), every family gets its trigger / wait code (PDL), the
    early launch and its dependents let go first thing (no PDL_LATE)."""
    monkeypatch.setattr(pdl, "enabled", lambda kind, t, interpreting: True)
    x = torch.zeros(1)
    for kind in sorted(pdl.FAMILIES):
        assert pdl.launch_options(kind, x, False) == {"PDL": True, "launch_pdl": True}


@pytest.mark.parametrize("spec, launch, late", [("int4", True, False), ("int8", False, True),
                                                ("bf16", False, True)])
def test_decode_attention_asks_for_its_measured_placement(spec, launch, late, monkeypatch):
    """The decode configs' PDL placement (docs/BENCHMARKS.md): int4's
    full Gluon grid launches early and lets the reduce go first thing (a grid short of
    every SM launches normally); int8 (swap, 8 per SM)
    and bf16 (decode_warp) launch normally and let it go at their end."""
    monkeypatch.setattr(pdl, "enabled", lambda kind, t, interpreting: True)
    cache = ke.FullCache(spec, capacity=4096)
    k = torch.randn(1, 2, 40, 128, dtype=torch.bfloat16)
    cache.append(k, k)
    q = torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)
    view = cache.view()
    cfg = (ta.warp_decode_config(q, view) if spec == "bf16"
           else ta.swap_decode_config(q, view))
    # a grid that fills the machine (lengths on the device: sized by the capacity)
    lens = torch.tensor([40], dtype=torch.int32)
    cfg = (ta.warp_decode_config(q, view, lens) if spec == "bf16"
           else ta.swap_decode_config(q, view, lens))
    assert attn_launch.pdl_options("attention", q, cfg) == {"PDL": True, "PDL_LATE": late, "launch_pdl": launch}
    assert attn_launch.pdl_options("reduce", q) == {"PDL": True, "launch_pdl": True}
    if spec == "int4":  # a smaller grid launches normally (it would land unevenly)
        small = ta.swap_decode_config(q, view)
        assert small.num_splits < cfg.num_splits and not small.pdl_launch


def test_gemv_wait_placement_per_launch(monkeypatch) -> None:
    """The GEMVs wait after their first W tile in the residual (o, down) and RoPE (qkv)
    launches, first thing in the others (gate/up, lm_head); nothing when PDL is off."""
    from kvtax.models import gemv as gm

    x = torch.zeros(1)
    assert gm._pdl(x, rope=True, residual=True) == {}  # CPU: off
    monkeypatch.setattr(pdl, "enabled", lambda kind, t, interpreting: True)
    assert gm._pdl(x) == {"PDL": True, "PDL_FIRST": False, "launch_pdl": True}
    assert gm._pdl(x, rope=True)["PDL_FIRST"] is True
    assert gm._pdl(x, residual=True)["PDL_FIRST"] is True
