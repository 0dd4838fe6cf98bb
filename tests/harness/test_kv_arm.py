"""The one KV-arm grammar (`kvtax.harness.kv_arm`) and the bench plan that reads it."""

from __future__ import annotations

import re

import pytest

from kvtax.errors import FormatError
from kvtax.harness.bench.plan import SweepConfig
from kvtax.harness.kv_arm import KVArm, parse_arm, parse_arms


@pytest.mark.parametrize("text, base, layers, path", [
    ("int8", "int8", {}, None),
    ("int4/unfused", "int4", {}, "unfused"),
    ("int4-g32+hk+ck@s4r128", "int4-g32+hk+ck@s4r128", {}, None),
    ("int8+hk:L0=fp16:L8=int4/fused", "int8+hk", {0: "fp16", 8: "int4"}, "fused"),
    ("int4+hk@s4r16:l1=fp16", "int4+hk@s4r16", {1: "fp16"}, None),
    ("q8_0:q4_0/fa", "q8_0:q4_0", {}, "fa"),  # llama.cpp's K:V pair stays one name
])
def test_parse_splits_cache_layers_and_path(text, base, layers, path) -> None:
    arm = parse_arm(text)
    assert (arm.base, arm.layers, arm.path) == (base, layers, path)
    assert parse_arm(arm.name) == arm  # what rows store parses back to the same arm


def test_cache_and_name_are_what_rows_store() -> None:
    arm = parse_arm(" int8+hk:L8=int4:L0=fp16/fused ")
    assert arm.cache == "int8+hk:L0=fp16:L8=int4" and arm.name == arm.cache + "/fused"
    assert parse_arm("int4@r64").is_plain is False and parse_arm("int4").is_plain
    assert parse_arm("int8:L0=fp16").is_plain is False
    # a short name is what it stands for: `kvtax bench --kv q4` once failed as a plain format
    assert parse_arm("q4").is_plain is False and parse_arm("Q3").is_plain is False
    assert parse_arm("q8").is_plain


@pytest.mark.parametrize("old, new", [
    ("int8+hk/L0:fp16", "int8+hk:L0=fp16"),
    ("int4-g32+hk@s4r128/L0:fp16/L16:fp16", "int4-g32+hk@s4r128:L0=fp16:L16=fp16"),
    ("int8/l3:int4/fused", "int8:L3=int4/fused"),
])
def test_the_older_layer_spelling_is_refused_naming_the_new_one(old, new) -> None:
    with pytest.raises(FormatError, match=re.escape(f"'{new}'")):
        parse_arm(old)


@pytest.mark.parametrize("bad, says", [
    ("int8:0=fp16", "L<index>=<format>"),
    ("int8:L0=fp16:x", "L<index>=<format>"),
    ("int8/fused/x", "FORMAT"),
    ("int8/", "FORMAT"),
    (":L0=fp16", "no format"),
])
def test_malformed_arms_say_what_is_wrong(bad, says) -> None:
    with pytest.raises(FormatError, match=says):
        parse_arm(bad)


def test_check_and_fit() -> None:
    arm = parse_arm("int8+hk@s4r128:L0=int4")
    assert arm.fit(96).cache == "int8-g32+hk@s4r128:L0=int4-g32"
    assert parse_arm("int4/hf-quantized").fit(80).name == "int4-g16/hf-quantized"
    arm.check(128, num_layers=1)
    with pytest.raises(FormatError, match="outside 0..0"):
        parse_arm("int8:L1=fp16").check(num_layers=1)
    with pytest.raises(FormatError, match="unknown KV format"):
        parse_arm("int8:L0=int5").check()
    assert [a.base for a in parse_arms("fp16, int8 ,,int4@r8")] == ["fp16", "int8", "int4@r8"]
    assert isinstance(parse_arms("int8")[0], KVArm) and parse_arms(None) == []


def test_bench_plans_hybrid_and_per_layer_arms_on_the_fused_path_only() -> None:
    cfg = SweepConfig(model="tiny", kvs=["int8", "int4+hk@s4r16", "int8:L0=fp16", "q4"],
                      paths=["fused", "unfused"])
    assert cfg.arms() == [("int8", "fused"), ("int4+hk@s4r16", "fused"),
                          ("int8:L0=fp16", "fused"), ("k4w-c64v4@s4r128", "fused"),
                          ("int8", "unfused")]  # a short name runs as what it stands for
    for kvs, level, says in ((["int8/unfused"], "model", "--paths"),
                             (["int4@r8"], "attention", "--level model"),
                             (["int8:L99=fp16"], "model", "outside")):
        with pytest.raises(FormatError, match=says):
            SweepConfig(model="tiny", kvs=kvs, level=level).arms()


def test_bench_bytes_per_token_counts_each_layers_format() -> None:
    """A per-layer arm's token costs each layer's own format; a hybrid layer's one body row
    (its fp16 sinks and recent window are a fixed size, not a per-token cost)."""
    import torch

    from kvtax.formats import KVSpec
    from kvtax.formats.hybrid import parse_kv
    from kvtax.harness.bench.cells import model_bytes_per_token
    from kvtax.models import get_config

    cfg = get_config("tiny")
    d, h, n = cfg.head_dim, cfg.num_kv_heads, cfg.num_layers
    int8, fp16 = (KVSpec.parse(s).bytes_per_token(d, torch.float32) * h for s in ("int8", "fp16"))
    assert model_bytes_per_token(cfg, parse_kv("int8"), torch.float32) == n * int8
    assert model_bytes_per_token(cfg, parse_kv("int8"), torch.float32,
                                 {0: "fp16"}) == (n - 1) * int8 + fp16
    assert model_bytes_per_token(cfg, parse_kv("int8@s4r16"), torch.float32) == n * int8


def test_sliding_kv_reaches_quantized_arms_only():
    """--sliding-kv: quantized arms (plain, hybrid, per-layer) take it; an arm that stores
    nothing quantized (the fp16 baseline of quality and recall) stays unquantized."""
    for arm in ("int8", "q4", "fp16:L0=int4", "int4+hk@s4r32/fused"):
        assert parse_arm(arm).sliding("int4+hk@s4r32") == "int4+hk@s4r32"
    for arm in ("fp16", "bf16", "fp32/fused"):
        assert parse_arm(arm).sliding("int4+hk@s4r32") is None
    assert parse_arm("int8").sliding(None) is None
