"""Per-layer KV caches that store quantized rows: full and sliding-window.

    >>> from kvtax.cache import FullCache, SlidingCache, make_caches
    >>> cache = FullCache("int8", capacity=4096)   # preallocated, never moves
    >>> cache.append(k, v)                         # [B, H_kv, T, D]
    >>> cache.nbytes, cache.used_nbytes, len(cache)
"""

from kvtax.cache.base import BaseCache
from kvtax.cache.full import FullCache
from kvtax.cache.policy import make_caches
from kvtax.cache.sliding import SlidingCache

__all__ = ["BaseCache", "FullCache", "SlidingCache", "make_caches"]
