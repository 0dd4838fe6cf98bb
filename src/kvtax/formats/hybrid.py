"""Mixed-precision KV: sink and recent tokens kept unquantized, the body quantized.

Quantization error hurts most where attention concentrates: the first few tokens (the
"attention sinks" most heads park probability on) and the most recent ones. A hybrid spec
keeps the first `sinks` positions and, for each query, its `recent` nearest keys in an
unquantized format (fp16), and reads every other key from the quantized body.

Grammar (case-insensitive): `<spec>@s<S>r<R>[i8]`, either number may be left out:
  int4+hk@s4r128   Hadamard-rotated int4 body, 4 fp16 sinks, 128 fp16 recent tokens
  int4@r64         no sinks, 64 recent tokens
  k8v4@s16         16 sinks, no recent window
  k4-c64v4@r64i8   the sinks and recent tokens in int8 instead of fp16 (q4's form on a
                   sliding-window layer, there with values in groups of 128, where 64 fp16
                   tokens would weigh an eighth of a 512-token window). Plain per-token
                   int8, neither centered nor rotated:
                   where keys carry a large per-channel offset it is the worse part (on
                   Qwen2.5-Coder-0.5B's global layers `@s4r256i8` doubled q4's KL, layer 0
                   at 0.5 relative attention error; docs/QUALITY.md)

    >>> spec = parse_kv("int4+hk@s4r128")
    >>> spec.base.name, spec.sinks, spec.recent
    ('int4+hk', 4, 128)
    >>> type(parse_kv("int8")).__name__     # no '@': a plain KVSpec
    'KVSpec'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from kvtax.errors import FormatError
from kvtax.formats.spec import SLIDING_FORMS, KVSpec, expand_short, fit_head_dim

# s<S>r<R> (one of them at least), then `i8` for int8 sinks/recent tokens instead of fp16
_SUFFIX_RE = re.compile(r"^(?=[sr])(?:s(?P<s>\d+))?(?:r(?P<r>\d+))?(?P<i8>i8)?$")


@dataclass(frozen=True)
class HybridSpec:
    """A quantized body spec plus `sinks` leading and `recent` trailing fp16 tokens.

    base:   the body's KVSpec (e.g. int4+hk).
    sinks:  positions `[0, sinks)` are read unquantized by every query.
    recent: a query at position p reads keys `(p - recent, p]` unquantized.
    exempt: the format of sinks and recent tokens (fp16; int8 under an `i8` suffix).
    """

    base: KVSpec
    sinks: int = 0
    recent: int = 0
    exempt: KVSpec = field(default_factory=lambda: KVSpec.parse("fp16"))

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.recent < 0:
            raise FormatError(f"sinks and recent must be >= 0, got {self.sinks}, {self.recent}")

    @property
    def name(self) -> str:
        parts = f"s{self.sinks}" if self.sinks else ""
        parts += f"r{self.recent}" if self.recent else ""
        if parts and self.exempt.is_quantized:  # only the `i8` suffix stores them quantized
            parts += "i8"
        return f"{self.base.name}@{parts}" if parts else self.base.name

    @property
    def is_quantized(self) -> bool:
        return self.base.is_quantized

    def check(self, head_dim: int) -> None:
        self.base.check(head_dim)
        # named by the suffix, without a group: fitted to head_dim like any such name
        fit_head_dim(self.exempt.name, head_dim).check(head_dim)

    def bytes_for(self, tokens: int, head_dim: int,
                  model_dtype: torch.dtype = torch.float16) -> int:
        """Resident K+V bytes of one KV head holding `tokens` tokens (full-attention layer):
        the body stores every token, the exempt part the sinks and the recent window."""
        exempt = min(tokens, self.sinks) + min(max(tokens - self.sinks, 0), self.recent)
        return (tokens * self.base.bytes_per_token(head_dim, model_dtype)
                + exempt * self.exempt.bytes_per_token(head_dim, model_dtype))

    def __str__(self) -> str:
        return self.name


def parse_kv(text: "str | KVSpec | HybridSpec") -> "KVSpec | HybridSpec":
    """A KVSpec for a plain name, a HybridSpec for `<spec>@s<S>r<R>`; FormatError otherwise."""
    if isinstance(text, (KVSpec, HybridSpec)):
        return text
    raw = expand_short(str(text).strip().lower().replace(" ", ""))
    base, at, suffix = raw.partition("@")
    if not at:
        return KVSpec.parse(raw)
    m = _SUFFIX_RE.match(suffix)
    if not m:
        raise FormatError(
            f"spec {text!r}: after '@' write s<sinks>r<recent>[i8], e.g. int4+hk@s4r128, "
            "int4@r64, k4-c64v4@r64i8"
        )
    short = expand_short(base)
    if "@" in short:  # q4@s4r8: the short name already carries its own suffix
        raise FormatError(f"spec {text!r}: {base} already keeps fp16 tokens ({short}); "
                          f"write {short.partition('@')[0]}@{suffix} for other counts")
    spec = KVSpec.parse(base)
    if not spec.is_quantized:
        raise FormatError(f"spec {text!r}: the body {spec.name} is not quantized; drop the '@…'")
    exempt = KVSpec.parse("int8" if m["i8"] else "fp16")
    return HybridSpec(spec, int(m["s"] or 0), int(m["r"] or 0), exempt)


def sliding_form(spec: "str | KVSpec | HybridSpec") -> str | None:
    """The name of what a sliding-window layer stores under `spec` when a short name says
    it differs (`SLIDING_FORMS`: q4's `k4-c64v4-g128@r64i8`), else None. Matched by what
    the spec is, so "q4" and its expansion "k4w-c64v4@s4r128" both have it. A name, so a
    cache fits its groups to head_dim at the first append (`fit_head_dim`)."""
    name = parse_kv(spec).name
    for short, form in SLIDING_FORMS.items():
        if parse_kv(short).name == name:
            return form
    return None


def fit_kv_name(text: str, head_dim: int) -> str:
    """A format name (plain or hybrid) made valid for `head_dim`: named without `-g<N>`, it
    takes a group size dividing head_dim (`fit_head_dim`), the '@' suffix kept
    ("int8+hk@s4r128" at 96 → "int8-g32+hk@s4r128"). A name that fits already, or that is
    no format (an engine's own name such as "native"), is left as written."""
    base, at, suffix = expand_short(str(text)).partition("@")
    try:
        fitted, given = fit_head_dim(base, head_dim), KVSpec.parse(base)
    except FormatError:  # not a format here: the caller's parse reports it
        return str(text)
    return f"{fitted.name if fitted != given else base}{at}{suffix}"


def fit_kv(spec: "str | KVSpec | HybridSpec", head_dim: int) -> "KVSpec | HybridSpec":
    """`parse_kv(spec)` with a group size fitted to `head_dim` where the name gives none
    (`fit_head_dim`); a hybrid spec's body is fitted, its sinks/recent kept."""
    return parse_kv(fit_kv_name(spec, head_dim) if isinstance(spec, str) else spec)
