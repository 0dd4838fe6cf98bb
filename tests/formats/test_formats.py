"""KV formats: round-trip error bounds, exact byte arithmetic, packing layout, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from kvtax.errors import FormatError, NonFiniteError
from kvtax.formats import (
    AffineFormat,
    FloatFormat,
    FP8Format,
    KVSpec,
    check_input,
    parse_format,
)
from tests.support.tensors import errors, rand_kv

# Relative RMS round-trip error on N(0,1) rows of 128 dims. Affine: uniform rounding
# error scale/sqrt(12) with scale ≈ range/(2^b-1) ≈ 5σ/(2^b-1); fp8 e4m3 keeps 3
# mantissa bits (≤ 2^-4 relative rounding).
GAUSS_BOUNDS = {"int8": 0.01, "int4-g32": 0.12, "int4": 0.14, "int4-g128": 0.16, "fp8": 0.04,
                "fp8-pt": 0.04}
# One outlier channel ×10 per row widens its group's range ~4x (affine) but not fp8's
# per-element relative error much.
OUTLIER_BOUNDS = {"int8": 0.02, "int4-g32": 0.25, "int4": 0.3, "int4-g128": 0.35, "fp8": 0.04,
                  "fp8-pt": 0.04}


@pytest.mark.parametrize("name", list(GAUSS_BOUNDS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_round_trip_gaussian(name: str, dtype: torch.dtype) -> None:
    fmt = parse_format(name)
    x = rand_kv((3, 2, 97, 128), dtype=dtype)
    x_hat = fmt.dequantize(fmt.quantize(x))
    _, rel = errors(x_hat, x.float())
    assert rel <= GAUSS_BOUNDS[name], f"{name} {dtype}: rel RMS {rel:.4f}"
    assert rel > GAUSS_BOUNDS[name] / 20, "suspiciously exact: is it quantizing at all?"


@pytest.mark.parametrize("name", list(OUTLIER_BOUNDS))
def test_round_trip_outlier_channels(name: str) -> None:
    fmt = parse_format(name)
    x = rand_kv((2, 4, 200, 128), outliers=3, dtype=torch.float16)
    _, rel = errors(fmt.dequantize(fmt.quantize(x)), x.float())
    assert rel <= OUTLIER_BOUNDS[name], f"{name}: rel RMS {rel:.4f}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_affine_error_within_half_step(bits: int, group: int) -> None:
    """Every element lands within half a quantization step of its group (plus fp16 rounding)."""
    fmt = AffineFormat(bits, group)
    x = rand_kv((4, 50, 128), outliers=2, dtype=torch.float16)
    q = fmt.quantize(x)
    err = (fmt.dequantize(q) - x.float()).abs().unflatten(-1, (128 // group, group))
    step = q.scales.float().unsqueeze(-1)
    # bias is rounded to fp16 before encoding: allow its rounding (≤ 2^-11 relative).
    slack = q.biases.float().abs().unsqueeze(-1) * 2**-10 + 1e-6
    assert bool((err <= step / 2 + slack).all())


def test_constant_rows_are_exact() -> None:
    x = torch.full((2, 3, 5, 64), 0.375, dtype=torch.float16)
    for name in ("int8", "int4"):
        fmt = parse_format(name)
        assert torch.equal(fmt.dequantize(fmt.quantize(x)), x.float()), name
    # fp8's scale amax/448 is rounded to fp16, so the max lands within fp16 rounding.
    fp8 = parse_format("fp8")
    assert errors(fp8.dequantize(fp8.quantize(x)), x.float())[0] < 0.375 * 2**-10
    zeros = torch.zeros(1, 1, 2, 64)
    assert torch.equal(parse_format("int4").dequantize(parse_format("int4").quantize(zeros)), zeros)


def test_int4_split_half_packing() -> None:
    """Byte j holds dim j in its low nibble and dim j + D/2 in its high nibble."""
    d = 64
    codes = torch.randint(0, 16, (3, d))
    # With group = D, bias = min and scale = (max-min)/15: pin min 0 and max 15 so the
    # integers themselves are the codes.
    codes[:, 0], codes[:, 1] = 0, 15
    fmt = AffineFormat(4, 64)
    q = fmt.quantize(codes.float())
    assert q.codes.shape == (3, d // 2) and q.codes.dtype == torch.uint8
    assert torch.equal((q.codes & 0xF).long(), codes[:, : d // 2])
    assert torch.equal((q.codes >> 4).long(), codes[:, d // 2 :])


@pytest.mark.parametrize(
    "name,dtype,expected",
    [
        ("fp16", torch.float16, 256),
        ("bf16", torch.bfloat16, 256),
        ("int8", torch.float16, 128 + 2 * 2 * 2),
        ("int8-g32", torch.bfloat16, 128 + 4 * 2 * 2),
        ("int4", torch.float16, 64 + 2 * 2 * 2),
        ("int4-g128", torch.float16, 64 + 1 * 2 * 2),
        ("int4", torch.float32, 64 + 2 * 2 * 4),
        ("fp8", torch.float16, 128 + 2),
        ("fp8-pt", torch.bfloat16, 128),  # one scale per tensor: exactly a byte per element
    ],
)
def test_bytes_per_token_exact(name: str, dtype: torch.dtype, expected: int) -> None:
    fmt = parse_format(name)
    assert fmt.bytes_per_token(128, dtype) == expected
    stored = fmt.quantize(torch.randn(5, 7, 128).to(dtype))
    assert stored.nbytes == 5 * 7 * expected
    assert fmt.allocate((5, 7), 128, dtype).nbytes == 5 * 7 * expected


def test_scales_take_model_dtype() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        q = parse_format("int8").quantize(torch.randn(2, 64).to(dtype))
        assert q.scales.dtype == dtype and q.biases.dtype == dtype
        assert parse_format("fp8").quantize(torch.randn(2, 64).to(dtype)).scales.dtype == dtype


@pytest.mark.parametrize(
    "text,key,value",
    [
        ("int8", "int8", "int8"),
        ("INT4", "int4", "int4"),
        ("k8v4", "int8", "int4"),
        ("k16v4", "fp16", "int4"),
        ("kfp8v4-g32", "fp8", "int4-g32"),
        ("kint8vint4", "int8", "int4"),
        ("key=int8,value=int4", "int8", "int4"),
        ("fp8_e4m3", "fp8", "fp8"),
        ("fp8-pt", "fp8-pt", "fp8-pt"),
        ("kfp8-ptv4", "fp8-pt", "int4"),
        ("key=int8,value=fp8-pt", "int8", "fp8-pt"),
        ("int4-g32", "int4-g32", "int4-g32"),
    ],
)
def test_spec_parsing(text: str, key: str, value: str) -> None:
    spec = KVSpec.parse(text)
    assert (spec.key.name, spec.value.name) == (key, value)
    assert KVSpec.parse(spec.name) == spec, "canonical name must parse back to the same spec"


def test_spec_of_and_bytes() -> None:
    spec = KVSpec.of("int8", "int4")
    assert spec.name == "k8v4"
    assert spec.bytes_per_token(128) == 136 + 72
    assert KVSpec.of("fp16").bytes_per_token(128) == 512


@pytest.mark.parametrize(
    "text", ["int2", "fp4", "", "int4-g48", "fp16-g64", "key=int8", "k8", "int8-g512"]
)
def test_bad_format_names(text: str) -> None:
    with pytest.raises(FormatError):
        KVSpec.parse(text)


@pytest.mark.parametrize("name,head_dim", [("int8", 80), ("int4", 96), ("int4-g128", 64)])
def test_head_dim_not_divisible_by_group(name: str, head_dim: int) -> None:
    with pytest.raises(FormatError, match="not divisible by group size"):
        parse_format(name).quantize(torch.randn(2, head_dim))


def test_head_dim_80_with_group_16_works() -> None:
    fmt = parse_format("int4-g16")
    x = torch.randn(3, 80)
    assert errors(fmt.dequantize(fmt.quantize(x)), x)[1] < 0.1


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8], ids=str)
def test_unsupported_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(FormatError, match="float16, bfloat16 or float32"):
        check_input(torch.ones(2, 64, dtype=dtype), parse_format("int8"))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", ["fp16", "int8", "int4", "fp8"])
def test_non_finite_is_reported(bad: float, name: str) -> None:
    x = torch.randn(2, 3, 64)
    x[1, 2, 7] = bad
    with pytest.raises(NonFiniteError, match="1 NaN/Inf"):
        check_input(x, parse_format(name))


def test_float_format_kinds() -> None:
    assert FloatFormat("bf16").quantize(torch.randn(2, 8)).codes.dtype == torch.bfloat16
    assert FP8Format().code_dtype(torch.float16) == torch.float8_e4m3fn
    with pytest.raises(ValueError):
        FloatFormat("fp64")


def test_fp8_per_tensor_is_vllms_unit_scale() -> None:
    """fp8-pt: codes are e4m3(x) itself (scale 1.0, no scale array), saturating at ±448
    like vLLM's uncalibrated fp8 cache; fp8 scales each row to its own absmax instead."""
    pt, row = parse_format("fp8-pt"), parse_format("fp8")
    x = torch.tensor([[0.5, -3.0, 1000.0, -1000.0, 0.013]], dtype=torch.float16)
    q = pt.quantize(x)
    assert q.scales is None and q.biases is None and q.codes.dtype == torch.float8_e4m3fn
    assert torch.equal(q.codes.float(), x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert pt.dequantize(q).tolist()[0][:4] == [0.5, -3.0, 448.0, -448.0]
    assert row.dequantize(row.quantize(x))[0, 2].item() == pytest.approx(1000.0, rel=0.07)
    assert pt.part_bytes(128, torch.bfloat16) == (128, 0, 0)
    assert row.part_bytes(128, torch.bfloat16) == (128, 2, 0)
    assert parse_format("int8").part_bytes(128, torch.float16) == (128, 4, 4)
    assert pt != row and isinstance(pt, FP8Format)
