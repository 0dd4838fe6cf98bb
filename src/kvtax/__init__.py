"""kvtax: quantized KV caches that pay off, and measurements that prove it."""

from kvtax.attention import CacheView, attention
from kvtax.cache import FullCache, SlidingCache, make_caches
from kvtax.errors import CapacityError, FormatError, KVTaxError, NonFiniteError, ShapeError
from kvtax.formats import KVSpec, parse_format

__version__ = "0.1.0"

__all__ = [
    "CacheView",
    "CapacityError",
    "FormatError",
    "FullCache",
    "KVSpec",
    "KVTaxError",
    "NonFiniteError",
    "ShapeError",
    "SlidingCache",
    "attention",
    "make_caches",
    "parse_format",
]
