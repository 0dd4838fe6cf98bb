"""Swap the attention function the decoder calls, for the length of a `with` block.

The decoder calls `kvtax.attention.attention(q, cache.view(), scale=, softcap=)`; the
baselines (`kvtax.harness.baselines`) have the same signature. Patching the decoder
module's reference — undone on exit, never at import — lets one model run any path
without the models package knowing about the harness. Each cell runs in its own process,
so the patch never leaks into another measurement.

    >>> with use_attention(attention_unfused):
    ...     runner.decode_step(tok, caches)
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator

# Modules that bind `attention` at import and call it per layer.
TARGETS = ("kvtax.models.decoder",)


@contextlib.contextmanager
def use_attention(fn: Callable[..., object] | None) -> Iterator[None]:
    """Route the decoder's attention calls to `fn` (None or kvtax's own: no change)."""
    from kvtax.attention import attention as fused

    if fn is None or fn is fused or getattr(fn, "__name__", "") == "attention_fused":
        yield
        return
    saved = []
    try:
        for name in TARGETS:
            mod = importlib.import_module(name)
            if not hasattr(mod, "attention"):
                raise RuntimeError(
                    f"{name} has no module-level `attention`; the harness cannot swap the "
                    "attention path of this decoder"
                )
            saved.append((mod, mod.attention))
            mod.attention = fn
        yield
    finally:
        for mod, orig in saved:
            mod.attention = orig
