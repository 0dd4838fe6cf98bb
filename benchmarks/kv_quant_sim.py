"""Fake quantization of K/V (quantize → dequantize in torch) for `kv_screen.py`, exact about
what a real cache would store, and the bytes that cache holds.

A scheme is `k<bits><g|c><size>[+h][+ck][+pre]/v<bits>g<size>[+h][@s<S>r<R>]`:
  - `k4g32`: keys per token in groups of 32 along head_dim (affine: scale, zero = min);
  - `k4c64`: keys per channel over blocks of 64 consecutive tokens (KIVI); the last,
    incomplete block stays fp16 until it fills;
  - `+h` Hadamard rotation along head_dim before quantizing (undone after);
  - `+ck` one mean key per head (of the first `CENTER_TOKENS` positions) subtracted before
    quantizing and added back after (a real cache may drop it: exact under softmax);
  - `+pre` keys quantized before RoPE (the cache stores pre-RoPE keys, rotates on read);
  - `@s4r128` the first 4 positions and a recent window of 128 stay fp16.
Scales and zeros are stored in fp16 (2 + 2 bytes per group or per channel-block).
Aliases: `int4` = k4g64/v4g64, `int4-g32+hk+ck@s4r128` = k4g32+h+ck/v4g32@s4r128,
`int8` = k8g64/v8g64, `fp16` = K/V rounded to fp16 only (the baseline).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from kvtax.formats import rotate

CENTER_TOKENS = 256   # the mean key is taken over the first prefill chunk, as kvtax's +ck
META_BYTES = 4        # fp16 scale + fp16 zero per quantization group
META_DTYPE = torch.float16  # what scales/zeros are rounded to (float32: kvtax's fp32-model cache)

ALIASES = {
    "int4": "k4g64/v4g64",
    "int4-g32+hk+ck@s4r128": "k4g32+h+ck/v4g32@s4r128",
    "int8": "k8g64/v8g64",
}
_PART = re.compile(r"(?P<kv>[kv])(?P<bits>\d+)(?P<mode>[gc])(?P<size>\d+)(?P<flags>(\+(h|ck|pre))*)$")
_HYBRID = re.compile(r"s(?P<s>\d+)(r(?P<r>\d+))?$")


class SchemeError(ValueError):
    """A scheme name that does not parse; the message says why."""


@dataclass(frozen=True)
class Quant:
    """How one of K or V is quantized: bits, per-token groups ('g') or per-channel token
    blocks ('c') of `size`, and the transforms applied first."""

    bits: int
    mode: str
    size: int
    rotate: bool = False
    center: bool = False
    pre_rope: bool = False


@dataclass(frozen=True)
class Scheme:
    """A K/V fake-quantization scheme; k/v None means fp16 (rounding only)."""

    name: str
    k: Quant | None
    v: Quant | None
    sinks: int = 0
    recent: int = 0


def parse_scheme(name: str) -> Scheme:
    """`k4c32+pre/v4g32@s4r128` (or an alias, or `fp16`) → Scheme; SchemeError if bad."""
    text = ALIASES.get(name, name)
    if text == "fp16":
        return Scheme(name, None, None)
    body, _, hyb = text.partition("@")
    sinks = recent = 0
    if hyb:
        m = _HYBRID.match(hyb)
        if not m:
            raise SchemeError(f"{name!r}: the part after @ must be s<S>[r<R>], e.g. s4r128")
        sinks, recent = int(m["s"]), int(m["r"] or 0)
    parts = {}
    for part in body.split("/"):
        m = _PART.match(part)
        if not m:
            raise SchemeError(f"{name!r}: {part!r} is not k|v<bits><g|c><size>[+h][+ck][+pre]")
        flags = set(filter(None, m["flags"].split("+")))
        bits, size = int(m["bits"]), int(m["size"])
        if not 1 <= bits <= 8 or size < 1:
            raise SchemeError(f"{name!r}: bits must be 1-8 and size >= 1")
        if m["kv"] == "v" and (m["mode"] == "c" or flags & {"ck", "pre"}):
            raise SchemeError(f"{name!r}: values are quantized per token (g), without +ck/+pre")
        parts[m["kv"]] = Quant(bits, m["mode"], size, "h" in flags, "ck" in flags,
                               "pre" in flags)
    if set(parts) != {"k", "v"}:
        raise SchemeError(f"{name!r}: name both k... and v... parts, e.g. k4c32/v4g32")
    return Scheme(name, parts["k"], parts["v"], sinks, recent)


def affine(x: torch.Tensor, bits: int, dim: int, size: int) -> torch.Tensor:
    """Quantize → dequantize `x` in groups of `size` consecutive elements along `dim`
    (which must divide into whole groups): `x ≈ scale * q + zero`, q in [0, 2^bits),
    scale = (max - min) / (2^bits - 1), zero = min, both rounded to META_DTYPE before
    encoding (what a cache stores). Returns float32, the shape of x."""
    x = x.float().movedim(dim, -1)
    shape = x.shape
    if shape[-1] % size:
        raise ValueError(f"dim of {shape[-1]} is not a multiple of the group size {size}")
    g = x.reshape(*shape[:-1], shape[-1] // size, size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    levels = 2 ** bits - 1
    scale = ((hi - lo) / levels).to(META_DTYPE).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = lo.to(META_DTYPE).float()
    q = ((g - zero) / scale).round().clamp(0, levels)
    return (q * scale + zero).reshape(shape).movedim(-1, dim)


def fake_quant(x: torch.Tensor, q: Quant | None, *, sinks: int, keep_recent: int) -> torch.Tensor:
    """Fake-quantize keys or values `[B, H, T, D]` as a cache would store them: positions
    < `sinks` and the last `keep_recent` in fp16, the body quantized by `q` (per-channel:
    whole blocks of q.size tokens from position `sinks`, a trailing partial block fp16).
    Returns float32 `[B, H, T, D]`."""
    x16 = x.half().float()
    if q is None:
        return x16
    t = x.shape[2]
    lo, hi = min(sinks, t), max(min(sinks, t), t - keep_recent)
    if q.mode == "c":
        hi = lo + (hi - lo) // q.size * q.size
    if hi <= lo:
        return x16
    mean = x16[:, :, :CENTER_TOKENS].mean(2, keepdim=True).half().float() if q.center else 0.0
    body = x16[:, :, lo:hi] - mean
    if q.rotate:
        body = rotate(body)
    body = affine(body, q.bits, 3 if q.mode == "g" else 2, q.size)
    if q.rotate:
        body = rotate(body)  # H is its own inverse
    out = x16.clone()
    out[:, :, lo:hi] = body + mean
    return out


def fp16_tokens(q: Quant | None, context: int, sinks: int, recent: int) -> int:
    """Tokens a real cache of `context` tokens holds in fp16: sinks, the recent window and,
    per-channel, the partial block waiting to fill."""
    held = min(context, sinks + recent)
    if q is not None and q.mode == "c":
        held += (context - held) % q.size
    return context if q is None else held


def bytes_ratio(scheme: Scheme, context: int, head_dim: int) -> float:
    """Bytes a real cache of `scheme` holds for `context` tokens (K and V, codes + fp16
    scales/zeros + fp16 sinks/window/partial block + a +ck mean), relative to fp16 K/V."""
    total = 0.0
    for q in (scheme.k, scheme.v):
        dense = fp16_tokens(q, context, scheme.sinks, scheme.recent)
        total += dense * head_dim * 2
        if q is not None:
            total += (context - dense) * head_dim * (q.bits / 8 + META_BYTES / q.size)
            total += head_dim * 2 if q.center else 0
    return total / (2 * context * head_dim * 2)


def with_bits(scheme: Scheme, k_bits: int | None = None, v_bits: int | None = None) -> Scheme:
    """The same scheme with other bit widths (for the tests' monotonicity checks)."""
    k = replace(scheme.k, bits=k_bits) if scheme.k and k_bits else scheme.k
    v = replace(scheme.v, bits=v_bits) if scheme.v and v_bits else scheme.v
    return replace(scheme, k=k, v=v)
