"""kvtax: quantized KV caches that pay off, and measurements that prove it.

The public names load on first use (PEP 562), so `import kvtax.harness.engines.llamacpp`
and `import kvtax.errors` do not import torch: a CUDA build of llama-cpp-python 0.3.36
segfaulted loading a model in a process that had imported torch 2.11 (H200, 2026-12-03).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Public name -> the module that defines it.
_HOMES = {
    "CacheView": "kvtax.attention",
    "attention": "kvtax.attention",
    "FullCache": "kvtax.cache",
    "SlidingCache": "kvtax.cache",
    "make_caches": "kvtax.cache",
    "CapacityError": "kvtax.errors",
    "FormatError": "kvtax.errors",
    "KVTaxError": "kvtax.errors",
    "NonFiniteError": "kvtax.errors",
    "ShapeError": "kvtax.errors",
    "KVSpec": "kvtax.formats",
    "parse_format": "kvtax.formats",
}


# Subpackages an eager `import kvtax` used to leave reachable as attributes.
_SUBPACKAGES = ("cache", "errors", "formats")


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"kvtax.{name}")
    if name not in _HOMES:
        raise AttributeError(f"module 'kvtax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """`kvtax.attention` is the function, as `from kvtax import attention` promises, even
    after the subpackage of that name is imported (which sets the attribute to the
    subpackage: `__getattr__` alone would then hand out the module)."""

    @property
    def attention(self) -> Any:
        return getattr(importlib.import_module("kvtax.attention"), "attention")

    @attention.setter
    def attention(self, value: Any) -> None:
        pass  # the import system recording the subpackage; sys.modules keeps it


sys.modules[__name__].__class__ = _Package
