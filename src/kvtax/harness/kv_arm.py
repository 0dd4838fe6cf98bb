"""The KV-arm grammar of `kvtax bench`, `kvtax recall` and `kvtax quality` (one parser).

An arm names what a layer's cache stores and, optionally, the attention path reading it:

    ARM     = CACHE [ "/" PATH ]
    CACHE   = FORMAT [ ":" "L" <layer> "=" FORMAT ]...
    FORMAT  = a KV format name (fp16, int8, int4-g32+hk+ck, k8v4, ...), optionally with
              "@s<sinks>r<recent>": fp16 attention sinks and recent window, quantized body

    int4+hk@s4r128             int4 body, 4 fp16 sinks and the 128 newest tokens in fp16
    int8+hk:L0=fp16:L8=fp16    int8+hk everywhere but layers 0 and 8 (fp16)
    int4/unfused               int4 read by the unfused baseline (`kvtax bench --paths`)

Each separator means one thing: "," between arms (command lines), "/" the path,
":L<i>=" a layer override (like llama.cpp's `--override-tensor PATTERN=TYPE`, an override
names what it overrides, then the type), "@" the fp16 sinks/recent suffix. Another
engine's arms use the same grammar with its own names: a ":" not followed by L<i>= is part
of the name (llama.cpp's K:V types, `q8_0:q4_0/fa`).
The older per-layer spelling "FORMAT/L0:fp16" is refused with the new one named.
A row's `kv` field holds CACHE, its `arm` field CACHE/PATH.

    >>> arm = parse_arm("int8+hk:L0=fp16/fused")
    >>> arm.cache, arm.base, arm.layers, arm.path
    ('int8+hk:L0=fp16', 'int8+hk', {0: 'fp16'}, 'fused')
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvtax.errors import FormatError
from kvtax.formats.hybrid import HybridSpec, fit_kv_name, parse_kv
from kvtax.formats.spec import KVSpec, expand_short

_LAYER = re.compile(r"^L(\d+)=(.+)$", re.IGNORECASE)
_OLD_LAYER = re.compile(r"^L\d+:", re.IGNORECASE)

GRAMMAR = ("FORMAT[@s<S>r<R>][:L<i>=FORMAT...][/PATH], e.g. int4+hk@s4r128, "
           "int8+hk:L0=fp16, int4/unfused")


@dataclass(frozen=True)
class KVArm:
    """One parsed arm: the cache of every layer (base + overrides) and the path, if given.

    base:   the format of every layer not overridden (hybrid suffix kept, `int4+hk@s4r128`).
    layers: layer index → format of that layer.
    path:   the attention path after "/", or None (the command's default path).
    """

    base: str
    layers: dict[int, str] = field(default_factory=dict)
    path: str | None = None

    @property
    def cache(self) -> str:
        """The CACHE part, as rows store it in `kv`: `int8+hk:L0=fp16`."""
        return self.base + "".join(f":L{i}={f}" for i, f in sorted(self.layers.items()))

    @property
    def name(self) -> str:
        """The arm as written back: CACHE, or CACHE/PATH when a path was given."""
        return self.cache + (f"/{self.path}" if self.path else "")

    @property
    def is_plain(self) -> bool:
        """True for one plain format in every layer (no overrides, no fp16 sinks/recent;
        a short name counts as what it stands for: q4 is hybrid, q8 plain)."""
        return not self.layers and "@" not in expand_short(self.base)

    def sliding(self, sliding_kv: str | None) -> str | None:
        """What `--sliding-kv` gives this arm's sliding-window layers: an arm that stores
        nothing quantized (fp16, bf16, fp32: the baseline every KL and recall count is held
        to) keeps every layer unquantized; others take `sliding_kv` (None: their own form)."""
        if sliding_kv is None or any(s.is_quantized for s in self.specs()):
            return sliding_kv
        return None

    def specs(self) -> list["KVSpec | HybridSpec"]:
        """The parsed formats of the arm, base first; FormatError names a bad one."""
        return [parse_kv(f) for f in (self.base, *self.layers.values())]

    def check(self, head_dim: int | None = None, num_layers: int | None = None) -> None:
        """FormatError where a format does not parse (or fit `head_dim`) or an override names
        a layer outside `0..num_layers - 1`."""
        for spec in self.specs():
            if head_dim is not None:
                spec.check(head_dim)
        if num_layers is not None:
            bad = sorted(i for i in self.layers if not 0 <= i < num_layers)
            if bad:
                raise FormatError(f"{self.cache!r} names layers {bad} outside "
                                  f"0..{num_layers - 1}")

    def fit(self, head_dim: int) -> "KVArm":
        """Every format named without `-g<N>` given a group size dividing `head_dim`
        (`int8:L0=int4` at 96 → `int8-g32:L0=int4-g32`; kvtax.formats.fit_head_dim)."""
        return KVArm(fit_kv_name(self.base, head_dim),
                     {i: fit_kv_name(f, head_dim) for i, f in self.layers.items()}, self.path)


def parse_arm(text: str) -> KVArm:
    """The KVArm of `text` (grammar above); FormatError, one line, for a malformed arm or
    the old `FORMAT/L<i>:FORMAT` spelling. Formats themselves are checked by `check`."""
    raw = str(text).strip()
    cache, slash, path = raw.partition("/")
    if _OLD_LAYER.match(path):
        raise FormatError(f"arm {raw!r}: layer overrides are written "
                          f"{_new_spelling(raw)!r} now (FORMAT:L<i>=FORMAT)")
    if slash and (not path or "/" in path):
        raise FormatError(f"arm {raw!r}: write {GRAMMAR}")
    first, *rest = cache.split(":")
    names, layers = [first], {}
    for part in rest:
        m = _LAYER.match(part)
        if m:
            layers[int(m[1])] = m[2]
        elif "=" in part or layers:  # an override, or a name part after the overrides
            raise FormatError(f"arm {raw!r}: a layer override is :L<index>=<format>, got "
                              f"{part!r}")
        else:
            names.append(part)
    base = ":".join(names)
    if not base:
        raise FormatError(f"arm {raw!r}: no format; write {GRAMMAR}")
    return KVArm(base, layers, path or None)


def parse_arms(text: str | None) -> list[KVArm]:
    """Comma-separated arms of a command line (`--kv fp16,int4+hk@s4r128`), blanks skipped."""
    return [parse_arm(a) for a in (text or "").split(",") if a.strip()]


def _new_spelling(old: str) -> str:
    """`int8+hk/L0:fp16/L8:int4` → `int8+hk:L0=fp16:L8=int4` (a trailing path kept)."""
    base, *parts = old.split("/")
    out, path = base, ""
    for part in parts:
        index, sep, fmt = part.partition(":")
        if sep and _OLD_LAYER.match(part):
            out += f":{index.upper()}={fmt}"
        else:
            path = f"/{part}"
    return out + path
