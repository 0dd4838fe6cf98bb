"""Per-layer cache choice: which layers slide, and which format each layer stores.

The one factory of per-layer caches: full, sliding, and hybrid (a format with fp16 sinks
and recent window, `int4+hk@s4r128`, kvtax.cache.hybrid) wherever a layer's format says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtax.cache.base import BaseCache
from kvtax.cache.full import FullCache
from kvtax.cache.hybrid import HybridCache
from kvtax.cache.sliding import SlidingCache
from kvtax.errors import FormatError
from kvtax.formats import KVSpec
from kvtax.formats.hybrid import HybridSpec, parse_kv, sliding_form

Spec = str | KVSpec | HybridSpec


def make_caches(
    windows: Sequence[int | None],
    spec: Spec = "fp16",
    *,
    sliding_spec: Spec | None = None,
    overrides: Mapping[int, Spec] | None = None,
    sinks: int = 0,
    capacity: int | None = None,
    max_chunk: int | None = None,
    check_finite: bool = True,
) -> list[BaseCache]:
    """One cache per layer.

    windows:      per layer, None for full attention or the sliding window size.
    spec:         format of full-attention layers (e.g. "int4", "k8v4", "int4+hk@s4r128").
    sliding_spec: format of sliding layers (default: `spec`, or the form its short name
                  stores there, kvtax.formats.spec.SLIDING_FORMS: q4's sliding layers hold
                  k4-c64v4-g128@r64i8); "fp16" keeps them unquantized.
    overrides:    layer index → format, applied last (e.g. keep layer 0 in fp16).
    capacity:     preallocate full caches to this many tokens (prompt + max new tokens).
    A hybrid format (`@s<S>r<R>`) gives that layer a HybridCache (a sliding layer's has no
    sinks and keeps min(recent, window) fp16 tokens).

    Example: `make_caches([512, 512, None], "int4", sliding_spec="fp16")`.
    """
    overrides = dict(overrides or {})
    bad = [i for i in overrides if not 0 <= i < len(windows)]
    if bad:
        raise FormatError(f"per-layer formats name layers {bad}, outside this model's layers "
                          f"0..{len(windows) - 1}")
    caches: list[BaseCache] = []
    for i, window in enumerate(windows):
        if window is None:
            layer_spec = overrides.get(i, spec)
        else:
            layer_spec = overrides.get(i, sliding_spec or sliding_form(spec) or spec)
        # a plain name goes on as given: the caches fit its group size to the head_dim
        if isinstance(parse_kv(layer_spec), HybridSpec):
            hybrid = HybridCache(layer_spec, window=window, capacity=capacity,
                                 max_chunk=max_chunk, check_finite=check_finite)
            caches.append(hybrid)  # type: ignore[arg-type]  # the same interface, no subclass
        elif window is None:
            caches.append(FullCache(layer_spec, capacity=capacity, check_finite=check_finite))
        else:
            caches.append(
                SlidingCache(
                    layer_spec,
                    window=window,
                    sinks=sinks,
                    max_chunk=max_chunk,
                    check_finite=check_finite,
                )
            )
    return caches
