"""`KVTaxCache`: a transformers `Cache` whose layers store K/V in kvtax formats.

    >>> from kvtax.hf import KVTaxCache, installed
    >>> with installed(model):
    ...     cache = KVTaxCache(model.config, kv="int8")
    ...     out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

Layer kinds follow the model config the way transformers' own caches read it
(`layer_types`, else `sliding_window`): full-attention layers get a `FullCache`,
sliding-window layers a `SlidingCache`. With `max_cache_len` the storage is preallocated
once and never changes shape, so transformers' static / `torch.compile` path can run.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from kvtax.cache import make_caches
from kvtax.formats import KVSpec, default_kv, fit_head_dim
from kvtax.formats.hybrid import HybridSpec, parse_kv
from kvtax.hf.layers import KVTaxLayer

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (multimodal models nest it)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def cache_kwarg(model) -> str:
    """The keyword `forward`/`generate` take a cache under: "cache" since transformers 5.2x
    renamed it, "past_key_values" before (still accepted, with a FutureWarning).

    Example: `model.generate(**inputs, **{cache_kwarg(model): KVTaxCache(model.config)})`.
    """
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Per layer: None for full attention, else the sliding window W (a query at p sees k
    iff p - k < W). Raises NotImplementedError for layer kinds kvtax cannot serve."""
    cfg = text_config(config)
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is None:
        if getattr(cfg, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        elif getattr(cfg, "sliding_window", None) is not None:
            types = ["sliding_attention"] * n  # e.g. Mistral: one window for every layer
        else:
            types = ["full_attention"] * n
    types = list(types)[:n]
    bad = sorted({t for t in types if t not in SUPPORTED_LAYER_TYPES})
    if bad:
        raise NotImplementedError(
            f"{cfg.model_type}: layer types {bad} are not supported by KVTaxCache (it serves "
            f"{', '.join(SUPPORTED_LAYER_TYPES)}); use transformers' DynamicCache for this model"
        )
    return [cfg.sliding_window if t == "sliding_attention" else None for t in types]


def fit_layer_spec(spec: "str | KVSpec | HybridSpec", head_dim: int) -> "KVSpec | HybridSpec":
    """`fit_head_dim` for any layer format: a hybrid one (`q4`, `<spec>@s<S>r<R>`) fits its
    quantized body's group size and keeps its fp16 sinks / recent tokens."""
    parsed = parse_kv(spec)
    if isinstance(parsed, HybridSpec):
        # a body named without a group size ("int4+hk@...") takes one dividing head_dim
        body = spec.partition("@")[0] if isinstance(spec, str) and "@" in spec else parsed.base
        return dataclasses.replace(parsed, base=fit_head_dim(body, head_dim))
    return fit_head_dim(spec, head_dim)


class KVTaxCache(Cache):
    """A transformers `Cache` of kvtax layers: quantized K/V, read in place by the kvtax attention.

    config:        the model config (`model.config`); decides layer count and kinds.
    kv:            format of full-attention layers, e.g. "int8", "int4", "k8v4", "fp16",
                   or a hybrid one ("q4", "q3", "int4+hk@s4r128": fp16 sink and recent
                   tokens beside a quantized body; eager only: no compiled / CUDA-graph
                   decode, no left-padded batches yet);
                   None: `kvtax.formats.default_kv` (int8+hk+ck; int8+hk for a model that
                   soft-caps attention logits). A name without `-g<N>` takes a group
                   size dividing head_dim (`fit_head_dim`; `cache.specs` says which).
    sliding_kv:    format of sliding-window layers (default: `kv`).
    overrides:     layer index → format, applied last (e.g. `{0: "fp16"}`).
    max_cache_len: preallocate every full layer for this many tokens (prompt + new tokens)
                   and fix every sliding ring, so storage never moves: `is_compileable`,
                   transformers' static/compiled generation path. None: storage grows.
    prefill_chunk: sliding layers attend a multi-token update in chunks of this many
                   tokens, so their ring holds `window - 1 + prefill_chunk` tokens.
    check_finite:  True, False, or "prefill" (default: check multi-token appends only).
                   Device-position decode steps are never checked (it would read the GPU).
    graph_decode:  with `max_cache_len`, decode one token at a device-side position and let
                   the fused kernels read lengths from the device: a compiled decode step
                   then has static shapes (CUDA-graph capturable). Only where kernels serve.

    Needs the kvtax attention installed on the model (`kvtax.hf.install(model)`).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        kv: str | KVSpec | None = None,
        *,
        sliding_kv: str | KVSpec | None = None,
        overrides: Mapping[int, str | KVSpec] | None = None,
        max_cache_len: int | None = None,
        prefill_chunk: int = 256,
        check_finite: bool | str = "prefill",
        graph_decode: bool = True,
    ) -> None:
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len must be positive, got {max_cache_len}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        windows = layer_windows(config)
        cfg = text_config(config)
        if kv is None:  # the default, without +ck where attention logits are soft-capped
            kv = default_kv(getattr(cfg, "attn_logit_softcapping", None))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # names without a group size take one dividing head_dim (Phi-3's 96: int8-g32+hk+ck)
        kv = fit_layer_spec(kv, head_dim)
        sliding_kv = fit_layer_spec(sliding_kv, head_dim) if sliding_kv else None
        overrides = {i: fit_layer_spec(s, head_dim) for i, s in (overrides or {}).items()}
        for spec in {kv, sliding_kv or kv, *overrides.values()}:
            spec.check(head_dim)  # fail here, not at the first forward
        caches = make_caches(
            windows,
            kv,
            sliding_spec=sliding_kv,
            overrides=overrides,
            capacity=max_cache_len,
            max_chunk=prefill_chunk if max_cache_len is not None else None,
            check_finite=check_finite is not False,
        )
        layers = [
            KVTaxLayer(
                cache,
                chunk=prefill_chunk if window is not None else None,
                check_finite=check_finite,
                max_cache_len=max_cache_len,
                graph_decode=graph_decode,
            )
            for cache, window in zip(caches, windows, strict=True)
        ]
        super().__init__(layers=layers)
        self.kv = kv
        self.windows = windows
        self.capacity = max_cache_len

    def __repr__(self) -> str:
        specs = sorted({layer.cache.spec.name for layer in self.layers})
        return (
            f"KVTaxCache(layers={len(self.layers)}, formats={specs}, "
            f"tokens={self.layers[0].seen if self.layers else 0}, nbytes={self.nbytes})"
        )

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K/V storage (codes + scales + biases) over all layers."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def used_nbytes(self) -> int:
        """Bytes of the tokens held (a sliding layer holds at most its ring)."""
        return sum(layer.used_nbytes for layer in self.layers)

    @property
    def specs(self) -> list[KVSpec]:
        """The K/V format of each layer."""
        return [layer.cache.spec for layer in self.layers]
