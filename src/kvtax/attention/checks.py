"""Input checks and the Hadamard-domain helpers every attention path shares.

The blockwise torch path, the fused kernels' launches, the stock baselines and the test
oracle (`reference.py`) all validate a query against a cache view the same way and move
queries / outputs into and out of a rotated spec's stored domain with these functions.
"""

from __future__ import annotations

import torch

from kvtax.attention.view import CacheView
from kvtax.errors import ShapeError
from kvtax.formats import rotate


def check_query(q: torch.Tensor, view: CacheView) -> tuple[int, int]:
    """Validate `q` `[B, H_q, L, D]` against a view; return (L, GQA group size)."""
    if q.dim() != 4:
        raise ShapeError(f"q must be [batch, q_heads, queries, head_dim], got {tuple(q.shape)}")
    b, hq, n_q, d = q.shape
    if d != view.head_dim:
        raise ShapeError(f"q has head_dim {d} but the cache stores {view.head_dim}")
    if b != view.batch:
        raise ShapeError(f"q has batch {b} but the cache holds batch {view.batch}")
    if hq % view.num_kv_heads:
        raise ShapeError(
            f"{hq} query heads cannot share {view.num_kv_heads} KV heads evenly "
            "(GQA needs q_heads % kv_heads == 0)"
        )
    if n_q > view.length:
        raise ShapeError(
            f"{n_q} queries but the cache holds only {view.length} positions; append the "
            "chunk's K/V before attending (queries are the last positions of the cache)"
        )
    if q.device != view.device:
        raise ShapeError(f"q is on {q.device} but the cache is on {view.device}")
    return n_q, hq // view.num_kv_heads


def check_kv_start(kv_start: torch.Tensor | None, view: CacheView) -> torch.Tensor | None:
    """Validate a per-batch first-valid-position tensor `[B]` (left padding); int64 or None."""
    if kv_start is None:
        return None
    if kv_start.shape != (view.batch,) or kv_start.is_floating_point():
        raise ShapeError(
            f"kv_start must be an integer tensor of shape [batch] = [{view.batch}], got "
            f"{kv_start.dtype} {tuple(kv_start.shape)}"
        )
    return kv_start.to(device=view.device, dtype=torch.int64)


def rotate_query(q: torch.Tensor, view: CacheView) -> torch.Tensor:
    """Queries in the stored keys' domain: `q H` when keys were stored Hadamard-rotated."""
    return rotate(q) if view.spec.rotate_keys else q


def unrotate_output(out: torch.Tensor, view: CacheView) -> torch.Tensor:
    """Attention output back from the stored values' domain (H is its own inverse)."""
    return rotate(out) if view.spec.rotate_values else out


def check_prior(prior, q: torch.Tensor) -> None:  # noqa: ANN001
    """ShapeError unless `prior` is None or contiguous float32 `(out [B, H_q, L, D],
    lse [B, H_q, L])` on q's device."""
    if prior is None:
        return
    o, lse = prior
    for t, shape in ((o, tuple(q.shape)), (lse, tuple(q.shape[:3]))):
        if (tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous()
                or t.device != q.device):
            raise ShapeError(f"prior tensors must be contiguous float32 {shape} on {q.device}, "
                             f"got {t.dtype} {tuple(t.shape)}")


def check_max_key(max_key: int | None, view: CacheView, kv_start, *, block_n: int  # noqa: ANN001
                  ) -> None:
    """ShapeError unless max_key is None or a positive multiple of the launch's block_n
    on a full cache without padding (the only layout the prefill kernel caps)."""
    if max_key is None:
        return
    if view.ring or view.window is not None or kv_start is not None:
        raise ShapeError("max_key applies to full caches without a window, ring or kv_start")
    if not 0 < max_key < 2**31 or max_key % block_n:
        raise ShapeError(f"max_key {max_key} must be a positive multiple of the launch's "
                         f"{block_n}-slot tiles")
