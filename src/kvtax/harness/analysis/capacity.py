"""Capacity arithmetic: how many tokens of KV cache fit a memory budget, per format.

vLLM 0.25.1 on an NVIDIA L4 (Llama-3.1-8B AWQ-INT4) measured its capacity at a 13.37 GiB
reservation: fp16 KV 109,504 tokens, fp8 219,008 (2.0x; its fp8 has one scale per tensor,
kvtax's `fp8-pt`: 219,054 here, vLLM rounds to 16-token blocks; kvtax's `fp8` carries a scale
per token and head: 215,684). Here the same question is answered from bytes per token (all
layers; a sliding-window layer never holds more than its window), and, given the weights,
the longest context that fits a device.

    >>> budget = parse_size("13.37GiB")
    >>> tokens_fitting(budget, kv_layout(get_config("llama-3.1-8b"), "fp16"))
    109527
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtax.formats import KVSpec
from kvtax.formats.hybrid import HybridSpec, fit_kv, sliding_form

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
UNBOUNDED = -1


def parse_size(text: str | int | float) -> int:
    """"13.37GiB" → bytes (GiB = 2^30, GB = 10^9, B = bytes). A string needs its unit
    ("13.37" alone once meant 13 bytes; only "0" may go without); an int or float is bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in _UNITS or (not m[2] and float(m[1]) != 0):
        raise ValueError(f"cannot read a size from {text!r}; give a unit, e.g. 13.37GiB, "
                         "16GB, 512MiB, 4096B")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def format_size(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class KVLayout:
    """Bytes one token adds: `full` over global layers; `sliding` (window, bytes) pairs;
    `fixed` (tokens, bytes) pairs: a hybrid spec's fp16 / int8 sinks and recent window,
    which hold at most that many tokens per layer whatever the context."""

    full: int
    sliding: tuple[tuple[int, int], ...] = ()
    fixed: tuple[tuple[int, int], ...] = ()

    def bytes_at(self, context: int) -> int:
        """Resident KV bytes of a `context`-token sequence (batch 1)."""
        return (self.full * context + sum(b * min(context, w) for w, b in self.sliding)
                + sum(b * min(context, n) for n, b in self.fixed))

    @property
    def per_token(self) -> int:
        """Bytes per token while every layer still grows (context below every window),
        the fixed parts left out (their whole size: `fixed_bytes`)."""
        return self.full + sum(b for _, b in self.sliding)

    @property
    def fixed_bytes(self) -> int:
        """Bytes of the fixed parts once full (sinks + recent tokens of every layer)."""
        return sum(b * n for n, b in self.fixed)


def _layer_specs(cfg: object, spec: "str | KVSpec | HybridSpec",
                 sliding_spec: "str | KVSpec | HybridSpec | None"):
    """(window or None, parsed spec) per layer: sliding layers take `sliding_spec`, else
    the form `spec`'s short name stores there (q4: k4-c64v4-g128@r64i8), else `spec`
    itself, as kvtax.cache.make_caches gives them; group sizes fitted to head_dim."""
    hd = cfg.head_dim  # type: ignore[attr-defined]
    full = fit_kv(spec, hd)
    sliding = fit_kv(sliding_spec or sliding_form(full) or full, hd)
    return [(w, full if w is None else sliding)
            for w in cfg.layer_windows()]  # type: ignore[attr-defined]


def kv_layout(cfg: object, spec: "str | KVSpec | HybridSpec",
              dtype: torch.dtype = torch.bfloat16,
              sliding_spec: "str | KVSpec | HybridSpec | None" = None) -> KVLayout:
    """KVLayout of a kvtax ModelConfig with K/V stored as `spec` (scales in `dtype`). A
    hybrid spec's body grows with the context; its sinks and recent window are `fixed`
    (a sliding layer keeps no sinks and at most its window: kvtax.cache.HybridCache)."""
    hd, hkv = cfg.head_dim, cfg.num_kv_heads  # type: ignore[attr-defined]
    full, sliding, fixed = 0, [], []
    for w, s in _layer_specs(cfg, spec, sliding_spec):
        if isinstance(s, HybridSpec):
            body = s.base.bytes_per_token(hd, dtype) * hkv
            exempt = fit_kv(s.exempt.name, hd).bytes_per_token(hd, dtype) * hkv
            if w is None:
                full += body
                fixed.append((s.sinks + s.recent, exempt))
            else:
                recent = min(s.recent, int(w))
                if recent < w:  # else every visible key is recent: no body
                    sliding.append((int(w), body))
                fixed.append((recent, exempt))
        elif w is None:
            full += s.bytes_per_token(hd, dtype) * hkv
        else:
            sliding.append((int(w), s.bytes_per_token(hd, dtype) * hkv))
    return KVLayout(full, tuple(sliding), tuple((n, b) for n, b in fixed if n))


def token_parts(cfg: object, spec: "str | KVSpec | HybridSpec",
                dtype: torch.dtype = torch.bfloat16,
                sliding_spec: "str | KVSpec | HybridSpec | None" = None
                ) -> tuple[int, int, int]:
    """(codes, scales, biases) bytes one token adds over every layer and KV head while
    every layer still grows: `kv_layout(...).per_token` split by what is stored (a hybrid
    spec's body)."""
    hd, hkv = cfg.head_dim, cfg.num_kv_heads  # type: ignore[attr-defined]
    total = [0, 0, 0]
    for w, s in _layer_specs(cfg, spec, sliding_spec):
        if isinstance(s, HybridSpec):
            if w is not None and min(s.recent, int(w)) >= w:
                continue  # no body on this layer
            s = s.base
        for fmt in (s.key, s.value):
            for i, b in enumerate(fmt.part_bytes(hd, dtype)):
                total[i] += b * hkv
    return total[0], total[1], total[2]


def tokens_fitting(budget: int, layout: KVLayout, batch: int = 1) -> int:
    """Longest context whose KV fits `budget` bytes (UNBOUNDED if sliding-only and fits)."""
    if budget < 0:
        return 0
    if layout.full == 0:
        cap = max((w for w, _ in layout.sliding), default=0)
        if batch * layout.bytes_at(cap) <= budget:
            return UNBOUNDED
    lo, hi = 0, 1
    while batch * layout.bytes_at(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # bytes_at is monotone: bisect the last context that fits
        mid = (lo + hi) // 2
        if batch * layout.bytes_at(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def longest_context(
    device_bytes: int, weight_bytes: int, layout: KVLayout, overhead_bytes: int = 0,
    batch: int = 1,
) -> int:
    """Longest context fitting a device: (memory - weights - overhead) / KV bytes."""
    return tokens_fitting(device_bytes - weight_bytes - overhead_bytes, layout, batch)


def measured_bytes_per_token(rows: Sequence[dict]) -> dict[str, float]:
    """Per arm: resident cache bytes / context from a run's ok rows (largest context)."""
    best: dict[str, tuple[int, float]] = {}
    for r in rows:
        if r.get("status") != "ok" or not r.get("cache_used_bytes") or not r.get("context"):
            continue
        ctx = int(r["context"])
        per = float(r["cache_used_bytes"]) / ctx
        if r["arm"] not in best or ctx > best[r["arm"]][0]:
            best[r["arm"]] = (ctx, per)
    return {arm: per for arm, (_, per) in best.items()}
