"""Format names and K/V pairs: `parse_format("int4-g32")`, `KVSpec.parse("k8v4")`.

Grammar (case-insensitive):
  format := fp16 | bf16 | fp32 | fp8 | fp8-pt | int8 | int4 | int3, optionally `-g<group>`
            for int formats (aliases: 16 → fp16, 8 → int8, 4 → int4, 3 → int3, fp8_e4m3 →
            fp8; int3 is read by the tile kernels only, docs/KERNELS.md); fp8 has a
            scale per token and head, fp8-pt one per tensor (1.0: vLLM's default fp8);
            int4-c64 / int3-c64: per channel over 64-token blocks (keys; kvtax.formats.channel);
            int4w-c64: int4-c64 with a fifth bit on the widest 3/8 channels of each
            sequence's first block (keys; kvtax.formats.widest)
  spec   := pair [+hk | +hkv] [+ck]       +hk: Hadamard-rotate keys before quantizing;
                                          +hkv: keys and values (kvtax.formats.rotation);
                                          +ck: center keys (subtract one per-channel mean
                                          vector, kvtax.cache.base; exact under softmax)
  pair   := format                      same format for K and V
          | k<format>v<format>          e.g. k8v4, kint8vint4, kfp8v4-g32
          | key=<format>,value=<format>
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass

import torch

from kvtax.errors import FormatError
from kvtax.formats.affine import GROUP_SIZES, AffineFormat
from kvtax.formats.base import KVFormat
from kvtax.formats.channel import BLOCK, ChannelBlockFormat
from kvtax.formats.floats import FloatFormat
from kvtax.formats.fp8 import FP8Format, FP8TensorFormat
from kvtax.formats.widest import WidestBitFormat

ROTATIONS = ("", "k", "kv")

# The recommended KV format where a caller names none (Runner, KVTaxCache, `kvtax
# generate`): int8 with Hadamard-rotated, centered keys. On Qwen2.5-Coder-0.5B plain int8
# missed the KL bound 7.7x (7.7e-3) and lost 2 of 20 planted facts fp16 found; +hk brought
# KL to 1.45e-3, +hk+ck to 2.1e-4 (target <= 1e-3) with fp16's recall to 32k; on Gemma-3
# +hk met the bound where plain int8 missed (docs/QUALITY.md). Cost: one [H_q, D] x [D, D]
# GEMM per decode call (H200 at 128k: 0.099 vs 0.092 ms per layer) and one subtraction
# per cache write (32k whole model: 6.09 vs 6.08 ms/token, docs/BENCHMARKS.md).
DEFAULT_KV = "int8+hk+ck"

# Short names a user can type for the recommended specs. q4: keys per channel over 64-token
# blocks with a fifth bit on the widest 3/8 of channels (int4w-c64, one channel order per
# sequence), values per token in groups of 64 (int4), 4 fp16 sink and 128 fp16 recent
# tokens (0.301 of fp16's bytes at 32k, head_dim 64). The fifth bit took the one cell
# plain int4-c64 keys missed, Gemma-3-270M at 32k (KL 1.24e-2 to 6.2e-3), and cut Qwen2.5-
# Coder-0.5B's KL 2-4x at 8k-32k (docs/QUALITY.md). On Qwen at 2k values in groups of 32
# read the same KL as 64 (2.2e-3 vs 2.4e-3, s.e. 3.5e-4) for 5% more bytes, and groups of
# 64 are what the fast decode kernels read (the scheme screen).
# q3: 3-bit keys (per channel) and values (groups of 32) with 96 fp16 recent tokens: 0.247 /
# 0.237 of fp16's bytes at 8k / 32k (head_dim 64). With q4's 128 it held 0.2505 at 8k, over
# the 0.25 a 3-bit cache is for; int3-c64 keys need >= 63. Read by the tile kernels.
SHORT_NAMES = {"q8": DEFAULT_KV, "q4": "k4w-c64v4@s4r128", "q3": "k3-c64v3-g32@s4r96"}
# What a short name stores on a sliding-window layer where that differs. int4-c64 keys need
# >= 63 recent tokens outside the body (a query never reads a block still open); on a
# 512-token window 64 fp16 ones weigh an eighth of the layer, so q4 keeps them in int8
# (`i8`), at half the KL of per-token int4+hk@s4r32 keys on Gemma-3-270M (15 of 18 layers
# slide; 3.1e-3 vs 6.2e-3 at 4k; keys carried its error: int8 keys 1.4e-3, int8 values
# 5.2e-3; docs/QUALITY.md). Values in groups of 128 (a head_dim-64 model fits them to 64):
# with q4's fifth key bit on the global layers, groups of 64 held 0.321 of fp16's bytes
# at 8k, over the 0.32 q4 is for; 128 holds 0.319 at the same KL (2.42e-3 vs 2.36e-3).
# q3: per-token int3 keys (groups of 64), Hadamard-rotated, with 16 fp16 recent
# tokens, the most that keeps Gemma-3-270M under 0.25 of fp16's bytes at 8k (0.247; q3's
# own form there, k3-c64v3-g32@s4r96, holds 0.288). Chosen from bytes alone.
SLIDING_FORMS = {"q4": "k4-c64v4-g128@r64i8", "q3": "int3+hk@s4r16"}


def expand_short(text: str) -> str:
    """The full spec a short name stands for ("q4" → "k4w-c64v4@s4r128"), else text."""
    return SHORT_NAMES.get(str(text).strip().lower(), text)


def centering_conflict(spec: "KVSpec", softcap: float | None) -> str | None:
    """Why `spec` cannot serve attention capped at `softcap`, or None. Centered keys
    (`+ck`) shift all of a query's scores by one amount, which softmax cancels but
    `softcap * tanh(s / softcap)` does not."""
    if softcap and spec.center_keys:
        return (f"KV spec {spec.name}: centered keys (+ck) are exact only without logit "
                f"soft-capping (attention here caps at {softcap}); drop +ck for this model")
    return None


def default_kv(attn_softcap: float | None = None, head_dim: int | None = None) -> str:
    """DEFAULT_KV for a model; without +ck where attention logits are soft-capped (Gemma 2),
    since capping is not shift-invariant; with `head_dim`, a group size that divides it
    (`fit_head_dim`: "int8-g32+hk+ck" at Phi-3's 96, "int8-g16+hk+ck" at 80)."""
    name = "int8+hk" if attn_softcap else DEFAULT_KV
    return name if head_dim is None else fit_head_dim(name, head_dim).name


_log = logging.getLogger("kvtax")
_fits_said: set[tuple[str, int]] = set()


def fit_head_dim(spec: "str | KVFormat | KVSpec", head_dim: int) -> "KVSpec":
    """`spec` made valid for rows of `head_dim`: an int format named without `-g<N>` takes
    the largest group size up to its default 64 that divides head_dim ("int8+hk+ck" at 96
    → "int8-g32+hk+ck"; rotation and centering kept), said once per name and head_dim on
    the "kvtax" logger. An explicit group wider than the row takes the largest that divides
    it, quietly (q4's sliding form, values in groups of 128, at head_dim 64 stores groups
    of 64: one per row, as asked); any other explicit group and a KVFormat / KVSpec object
    stay as given (`spec.check(head_dim)` then raises FormatError where they do not fit);
    per-channel keys (q4's int4-c64) have no group to fit and raise here where 64 does not
    divide head_dim."""
    parsed = KVSpec.parse(spec)
    if not isinstance(spec, str):
        return parsed
    if "-g" in spec.lower():
        return dataclasses.replace(parsed, key=_fit_wide(parsed.key, head_dim),
                                   value=_fit_wide(parsed.value, head_dim))
    for part in (parsed.key, parsed.value):  # no group to fit: refuse before saying "stored as"
        if isinstance(part, ChannelBlockFormat):
            part.check(head_dim)
    fitted = dataclasses.replace(parsed, key=_fit_group(parsed.key, head_dim),
                                 value=_fit_group(parsed.value, head_dim))
    if fitted != parsed and (spec, head_dim) not in _fits_said:
        _fits_said.add((spec, head_dim))
        _log.warning("kvtax: KV format %s at head_dim %d (group size 64 does not divide it) "
                     "is stored as %s", spec, head_dim, fitted.name)
    return fitted


def _fit_wide(fmt: KVFormat, head_dim: int) -> KVFormat:
    """An explicit group wider than the row → the largest group size that divides it."""
    if isinstance(fmt, AffineFormat) and fmt.group_size > head_dim:
        return _fit_group(fmt, head_dim)
    return fmt


def _fit_group(fmt: KVFormat, head_dim: int) -> KVFormat:
    if not isinstance(fmt, AffineFormat) or head_dim % fmt.group_size == 0:
        return fmt
    fits = [g for g in GROUP_SIZES if head_dim % g == 0 and g <= fmt.group_size]
    return AffineFormat(fmt.n_bits, max(fits)) if fits else fmt


FORMAT_NAMES = ("fp16", "bf16", "fp32", "fp8", "fp8-pt", "int8", "int4", "int3")
_ALIASES = {"16": "fp16", "8": "int8", "4": "int4", "3": "int3", "4w": "int4w",
            "fp8_e4m3": "fp8", "e4m3": "fp8"}
_FORMAT_RE = re.compile(r"^(?P<base>[a-z0-9_]+?)(?:-(?P<kind>[gc])(?P<group>\d+))?$")
_PAIR_RE = re.compile(r"^k(?P<k>[a-z0-9_\-]+?)v(?P<v>[a-z0-9_\-]+)$")


def parse_format(name: str | KVFormat) -> KVFormat:
    """Return the KVFormat a user-facing name denotes; FormatError lists valid names."""
    if isinstance(name, KVFormat):
        return name
    text = str(name).strip().lower()
    if text == "fp8-pt":
        return FP8TensorFormat()
    m = _FORMAT_RE.match(text)
    base = _ALIASES.get(m["base"], m["base"]) if m else None
    if base not in FORMAT_NAMES and not (base == "int4w" and m and m["kind"] == "c"):
        raise FormatError(
            f"unknown KV format {name!r}; valid formats: {', '.join(FORMAT_NAMES)} "
            "(int formats take a group suffix such as int4-g32), a K/V pair like k8v4, "
            "or a short name: q8, q4, q3"
        )
    assert m is not None
    group = m["group"]
    if m["kind"] == "c":
        if base not in ("int4", "int3", "int4w") or int(group) != BLOCK:
            raise FormatError(f"per-channel block formats are int4-c{BLOCK}, int3-c{BLOCK} "
                              f"and int4w-c{BLOCK}, got '{base}-c{group}'")
        return WidestBitFormat() if base == "int4w" else ChannelBlockFormat(int(base[3:]))
    if base in ("int8", "int4", "int3"):
        return AffineFormat(int(base[3:]), int(group) if group else 64)
    if group:
        raise FormatError(f"format {base} has no group size; drop '-g{group}'")
    if base == "fp8":
        return FP8Format()
    return FloatFormat(base)


@dataclass(frozen=True)
class KVSpec:
    """The formats of K and V for one layer (they may differ, e.g. `k8v4`).

    Example: `KVSpec.parse("k8v4").value` is `AffineFormat(4, 64)`;
    `KVSpec.parse("int8").bytes_per_token(128)` is 272 (K and V, one KV head).
    """

    key: KVFormat
    value: KVFormat
    rotate: str = ""  # "", "k" or "kv": which of K/V are Hadamard-rotated before storing
    # Keys are stored minus one per-(sequence, KV head) vector fixed at the first write
    # (the mean of the prompt's first chunk). Every score of a query moves by the same
    # q·m, which softmax cancels, so attention is unchanged in exact arithmetic while
    # a model's constant per-channel key offsets (Qwen's k_proj bias: layer 0's keys are
    # mostly offset) no longer set the quantization ranges. Not with logit soft-capping,
    # which is not shift-invariant (attention refuses that combination).
    center_keys: bool = False

    def __post_init__(self) -> None:
        if self.rotate not in ROTATIONS:
            raise FormatError(f"rotate must be one of {ROTATIONS}, got {self.rotate!r}")

    @property
    def rotate_keys(self) -> bool:
        return "k" in self.rotate

    @property
    def rotate_values(self) -> bool:
        return "v" in self.rotate

    @classmethod
    def parse(cls, spec: "str | KVFormat | KVSpec") -> "KVSpec":
        if isinstance(spec, KVSpec):
            return spec
        if isinstance(spec, KVFormat):
            return cls(spec, spec)
        text = expand_short(str(spec).strip().lower().replace(" ", ""))
        if "@" in text:
            named = repr(spec) if text == str(spec).strip().lower() else f"{spec!r} ({text})"
            raise FormatError(
                f"spec {named} is a hybrid spec (fp16 sinks/recent around a quantized "
                "body): kvtax.formats.hybrid.parse_kv, HybridCache, `kvtax quality` and "
                "`kvtax recall` take it; here drop the '@…'"
            )
        text, plus, rest = text.partition("+")
        if plus:
            suffixes = rest.split("+")
            rot = [x for x in suffixes if x in ("hk", "hkv")]
            bad = [x for x in suffixes if x not in ("hk", "hkv", "ck")]
            if bad or len(rot) > 1 or suffixes.count("ck") > 1:
                raise FormatError(
                    f"spec {spec!r}: suffixes are +hk (rotate keys) or +hkv (keys and "
                    "values), and +ck (center keys), each at most once, e.g. int8+hk+ck"
                )
            base = cls.parse(text)
            return cls(base.key, base.value, rot[0][1:] if rot else "", "ck" in suffixes)
        if text.startswith("key="):
            parts = dict(p.split("=", 1) for p in text.split(",") if "=" in p)
            if set(parts) != {"key", "value"}:
                raise FormatError(f"spec {spec!r}: write it as key=<format>,value=<format>")
            return cls(parse_format(parts["key"]), parse_format(parts["value"]))
        pair = _PAIR_RE.match(text)
        if pair and text not in FORMAT_NAMES:
            return _values_per_token(cls(parse_format(pair["k"]), parse_format(pair["v"])))
        fmt = parse_format(text)
        return _values_per_token(cls(fmt, fmt))

    @classmethod
    def of(cls, key: str | KVFormat, value: str | KVFormat | None = None) -> "KVSpec":
        """`KVSpec.of("int8", "int4")`; one argument means the same format for both."""
        k = parse_format(key)
        return cls(k, k if value is None else parse_format(value))

    @property
    def name(self) -> str:
        pair = self.key.name if self.key == self.value else f"k{_short(self.key)}v{_short(self.value)}"
        pair = f"{pair}+h{self.rotate}" if self.rotate else pair
        return f"{pair}+ck" if self.center_keys else pair

    @property
    def is_quantized(self) -> bool:
        return self.key.is_quantized or self.value.is_quantized

    def check(self, head_dim: int) -> None:
        self.key.check(head_dim)
        self.value.check(head_dim)

    def bytes_per_token(self, head_dim: int, model_dtype: torch.dtype = torch.float16) -> int:
        """Resident bytes of K plus V for one token of one KV head."""
        return self.key.bytes_per_token(head_dim, model_dtype) + self.value.bytes_per_token(
            head_dim, model_dtype
        )

    def __str__(self) -> str:
        return self.name


def _values_per_token(spec: KVSpec) -> KVSpec:
    """spec, or FormatError where its values are in a per-channel block format: a named
    spec says so before any cache or benchmark cell is built (caches refuse it too)."""
    if isinstance(spec.value, ChannelBlockFormat):
        raise FormatError(f"{spec.value.name} is a key format (per channel over token blocks); "
                          f"store values per token, e.g. k{_short(spec.key)}v4")
    return spec


def _short(fmt: KVFormat) -> str:
    """Compact name inside a k…v… pair: int8 → 8, int4-g32 → 4-g32."""
    return fmt.name[3:] if fmt.name.startswith("int") else fmt.name
