"""kvtax for Hugging Face transformers: a quantized cache stock models read through fused attention.

    >>> import kvtax.hf as kh
    >>> with kh.installed(model):                      # explicit and reversible
    ...     cache = kh.KVTaxCache(model.config, kv="int8")
    ...     ids = model.generate(**inputs, cache=cache, max_new_tokens=64)
    >>> cache.nbytes                                   # resident K/V bytes
    >>> # transformers before 5.2x names the argument `past_key_values=` (5.2x deprecates
    >>> # it with a FutureWarning); `cache_kwarg(model)` says which one a model takes.

How it plugs in (kvtax.hf.layers, .attention, .positions):
- `KVTaxCache.update(k, v, layer_idx)` returns a `KVHandle` for key and value instead of
  tensors; transformers hands it untouched to the attention function registered as
  "kvtax", which appends the new tokens to that layer's kvtax cache and runs
  `kvtax.attention.attention(q, view)` on the quantized storage (fused kernels on CUDA,
  the blockwise reference elsewhere). The whole cache is never dequantized.
- The mask function registered as "kvtax" returns None, or a `[B, 1, 1, P]` key-validity
  mask when rows are left-padded (passed on as per-row `kv_start`); the cache view itself
  applies causality and sliding windows. Patterns kvtax cannot reproduce are refused.
- `KVTaxCache(model.config, kv="int4", max_cache_len=N)` preallocates storage for N tokens
  (`is_compileable`): transformers' static / `torch.compile` path runs, and decode steps
  go through device-side positions so a compiled step has static shapes.
"""

from kvtax.hf.attention import ATTN_NAME, kvtax_attention_forward, kvtax_mask
from kvtax.hf.cache import KVTaxCache, cache_kwarg, layer_windows
from kvtax.hf.install import (
    TESTED_FAMILIES,
    install,
    installed,
    is_installed,
    register,
    uninstall,
    unregister,
)
from kvtax.hf.layers import KVHandle, KVTaxLayer

__all__ = [
    "ATTN_NAME",
    "TESTED_FAMILIES",
    "KVHandle",
    "KVTaxCache",
    "KVTaxLayer",
    "cache_kwarg",
    "install",
    "installed",
    "is_installed",
    "kvtax_attention_forward",
    "kvtax_mask",
    "layer_windows",
    "register",
    "uninstall",
    "unregister",
]
