"""Swap the attention function a decoder's layers call (and pin torch SDPA's backend), for
the length of a `with` block.

Each decoder layer calls `self.attn_fn(q, cache.view(), scale=, softcap=)` (kvtax's
`attention` by default); the baselines (`kvtax.attention.baselines`) have the same
signature. Setting it per model — undone on exit — lets one model run any path without
the models package knowing about the harness.

    >>> with use_attention(model, attention_unfused):
    ...     runner.decode_step(tok, caches)
    >>> with use_sdpa_backend("efficient"):   # what the fp16 / dequant baselines call
    ...     runner.decode_greedy(tok, caches)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

# `use_sdpa_backend` names → torch's SDPBackend members ("auto": torch's own choice).
SDPA_BACKENDS = {"auto": None, "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


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


@contextlib.contextmanager
def use_sdpa_backend(name: str = "auto") -> Iterator[None]:
    """Allow torch SDPA only `name`'s backend ("flash", "efficient", "cudnn", "math"), or
    torch's own choice ("auto"). A call that backend cannot serve raises (SDPA's "No
    available kernel"), never falls back silently: the baselines keep the query heads and ask for
    GQA (`enable_gqa`), which not every backend serves (the efficient one does not under
    the captured form's dense mask); `fold_gqa=True` folds the group into query rows,
    which all do. A captured CUDA graph keeps the kernel chosen while it
    was captured, so capture inside the block."""
    if name not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {name!r} (known: {', '.join(SDPA_BACKENDS)})")
    member = SDPA_BACKENDS[name]
    if member is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, member)]):
        yield
