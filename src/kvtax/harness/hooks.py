"""Swap the attention function a decoder's layers call, for the length of a `with` block.

Each decoder layer calls `self.attn_fn(q, cache.view(), scale=, softcap=)` (kvtax's
`attention` by default); the baselines (`kvtax.harness.baselines`) have the same
signature. Setting it per model — undone on exit — lets one model run any path without
the models package knowing about the harness.

    >>> with use_attention(model, attention_unfused):
    ...     runner.decode_step(tok, caches)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def use_attention(model: torch.nn.Module, fn: Callable[..., object] | None) -> Iterator[None]:
    """Route `model`'s attention calls to `fn` (None: leave them as they are)."""
    layers = [m for m in model.modules() if hasattr(m, "attn_fn")]
    if fn is not None and not layers:
        raise RuntimeError(
            f"{type(model).__name__} has no layer with an `attn_fn`; the harness cannot swap "
            "its attention path"
        )
    saved = [(m, m.attn_fn) for m in layers]
    try:
        if fn is not None:
            for m in layers:
                m.attn_fn = fn
        yield
    finally:
        for m, orig in saved:
            m.attn_fn = orig
