"""benchmarks/variants.py: decode.py's launch variants override the defaults and restore them."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from kvtax.attention import triton_api as ta
from kvtax.models import get_config, load_model
from kvtax.models import gemv as gm

pytestmark = pytest.mark.kernels
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def variants():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("variants", ROOT / "benchmarks" / "variants.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.fixture(scope="module")
def model():
    return load_model(get_config("tiny"), dtype=torch.float32, device="cpu", seed=0)


def test_parse_names_bad_items(variants) -> None:
    assert variants.parse("gemv.block_k=1024, o.block_n=2,attn.per_sm=6") == {
        "gemv": {"block_k": 1024}, "o": {"block_n": 2}, "attn": {"per_sm": 6}}
    assert variants.parse("") == {}
    for bad in ("block_k=1024", "gemv.bogus=1", "attn.block_k=2", "qkvx.block_n=2",
                "o.block_n=two", "step.fast=1"):
        with pytest.raises(SystemExit, match="SCOPE.FIELD=INT"):
            variants.parse(bad)
    # step.greedy picks decode.py's timed step
    assert variants.greedy_step("step.greedy=0") is False
    assert variants.greedy_step("") is True and variants.greedy_step("", False) is False


def test_apply_switches_the_rope_source_then_restores(variants, model) -> None:
    assert model.rope_freqs is True
    with variants.apply("step.rope_freqs=0", model):
        assert model.rope_freqs is False
    assert model.rope_freqs is True


def test_apply_overrides_one_projection_then_restores(variants, model) -> None:
    blk, cfg = model.layers[0], model.config
    o_shape = blk.attn.wo.weight.shape
    qkv_shape = blk.attn.wqkv.weight.shape
    base_o = gm.default_config(*o_shape)
    base_qkv = gm.default_config(*qkv_shape)
    assert o_shape != qkv_shape, "the tiny config must tell o from qkv"
    with variants.apply("o.block_n=2,gemv.num_stages=3", model):
        o = gm.default_config(*o_shape)
        qkv = gm.default_config(*qkv_shape)
        assert (o.block_n, o.num_stages) == (2, 3)
        assert qkv.num_stages == 3 and qkv.block_n == base_qkv.block_n
    assert gm.default_config(*o_shape) == base_o
    assert cfg.hidden_size == o_shape[0]


def test_apply_forces_attention_launch_fields(variants, model) -> None:
    """The decode-attention launch helpers see the variant's fields whatever the caller
    passed (launch_config passes per_sm=4 for float caches), and come back afterwards."""
    base = (ta.swap_decode_config, ta.warp_decode_config)
    seen = []

    @functools.wraps(ta.warp_decode_config)
    def spy(q, view, lengths=None, **kw):
        seen.append(kw)
        return "config"

    ta.warp_decode_config = spy
    try:
        with variants.apply("attn.per_sm=6,attn.num_stages=2", model):
            assert ta.warp_decode_config(None, None, per_sm=4) == "config"
            assert ta.swap_decode_config is not base[0]
        assert seen == [{"per_sm": 6, "num_stages": 2}]
        assert ta.warp_decode_config is spy
    finally:
        ta.swap_decode_config, ta.warp_decode_config = base


def test_apply_switches_pdl_families_then_restores(variants, model) -> None:
    """pdl.FIELD=0 takes one kernel family out of kvtax.pdl.KINDS (=1 puts it back),
    pdl.on the global switch; all of it comes back afterwards."""
    from kvtax import pdl

    saved = (pdl.USE_PDL, pdl.KINDS, pdl.LATE, gm.PDL_FIRST)
    with variants.apply("pdl.attn=0,pdl.reduce=0,pdl.first=1,pdl.store_late=1", model):
        assert pdl.KINDS == pdl.ALL_KINDS - {"attention", "reduce"}
        assert "store" in pdl.LATE
        assert gm.PDL_FIRST == 1
        with variants.apply("pdl.on=0,pdl.reduce=1", model):
            assert pdl.USE_PDL is False and "reduce" in pdl.KINDS
            assert "attention" not in pdl.KINDS
        assert pdl.KINDS == pdl.ALL_KINDS - {"attention", "reduce"}
    assert (pdl.USE_PDL, pdl.KINDS, pdl.LATE, gm.PDL_FIRST) == saved
    with pytest.raises(SystemExit, match="pdl.FIELD"):
        variants.parse("pdl.bogus=1")
