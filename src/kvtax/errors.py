"""Exceptions kvtax raises for bad input. Each message says what was wrong and what to do."""

from __future__ import annotations


class KVTaxError(Exception):
    """Base class of every error kvtax raises on purpose."""


class FormatError(KVTaxError, ValueError):
    """An unknown KV format name, a bad group size, or an unsupported dtype."""


class ShapeError(KVTaxError, ValueError):
    """Tensors whose shapes, head counts or devices do not fit together."""


class NonFiniteError(KVTaxError, ValueError):
    """K or V holds NaN or Inf; quantizing it would silently poison the scales."""


class CapacityError(KVTaxError, RuntimeError):
    """An append past a cache's fixed capacity."""


class OptionError(KVTaxError, ValueError):
    """Options that cannot run together or on this device (e.g. a compiled CUDA-graph
    decode step on a CPU model)."""


class ModelNotFoundError(KVTaxError, FileNotFoundError):
    """A --model that is neither a built-in config, a model folder, a .gguf file nor a hub id."""


class TokenizerError(KVTaxError, ValueError):
    """A tokenizer that cannot be what the model was trained with (e.g. a GGUF tokenizer
    converted to one token per character)."""
