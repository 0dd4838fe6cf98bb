"""Explicit, reversible installation of the kvtax attention into transformers.

Nothing happens at import. `install(model)` registers the kvtax attention and mask
functions under the name "kvtax" and switches this model to them; `uninstall(model)`
switches it back and, once no model uses them, removes both registrations, restoring
whatever was registered under that name before. `installed(model)` does both around a
block. A model family the adapter has not been tested with gets a warning.

    >>> with kvtax.hf.installed(model):
    ...     model.generate(**inputs, past_key_values=KVTaxCache(model.config, kv="int4"))
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from transformers import PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from kvtax.hf.attention import ATTN_NAME, kvtax_attention_forward, kvtax_mask
from kvtax.hf.cache import layer_windows, text_config

# model_type values whose generation the test suite checks against DynamicCache.
TESTED_FAMILIES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text"}
)

_MISSING = object()
_registry: dict[str, object] = {"users": 0}
_PREVIOUS_ATTR = "_kvtax_previous_attn_implementation"


def register() -> None:
    """Register the kvtax attention and mask functions (counted; see `unregister`)."""
    if _registry["users"] == 0:
        _registry["attn"] = AttentionInterface._global_mapping.get(ATTN_NAME, _MISSING)
        _registry["mask"] = AttentionMaskInterface._global_mapping.get(ATTN_NAME, _MISSING)
        AttentionInterface.register(ATTN_NAME, kvtax_attention_forward)
        AttentionMaskInterface.register(ATTN_NAME, kvtax_mask)
    _registry["users"] = int(_registry["users"]) + 1  # type: ignore[call-overload]


def unregister() -> None:
    """Drop one registration; the last one restores the registries as they were."""
    users = int(_registry["users"])  # type: ignore[call-overload]
    if users == 0:
        return
    _registry["users"] = users - 1
    if users > 1:
        return
    for mapping, key in (
        (AttentionInterface._global_mapping, "attn"),
        (AttentionMaskInterface._global_mapping, "mask"),
    ):
        previous = _registry.pop(key)
        if previous is _MISSING:
            mapping.pop(ATTN_NAME, None)
        else:
            mapping[ATTN_NAME] = previous


def is_installed(model: PreTrainedModel) -> bool:
    return hasattr(model, _PREVIOUS_ATTR)


def install(model: PreTrainedModel, *, warn_untested: bool = True) -> PreTrainedModel:
    """Make `model` run its attention through kvtax; returns the model.

    Raises NotImplementedError for configs kvtax cannot serve (chunked or bidirectional
    attention, layer types other than full and sliding-window); warns for families not in
    TESTED_FAMILIES. From here on the model needs a KVTaxCache for every forward.
    """
    if is_installed(model):
        raise RuntimeError("kvtax is already installed on this model; uninstall it first")
    cfg = text_config(model.config)
    layer_windows(cfg)  # raises for layer kinds kvtax cannot serve
    if getattr(cfg, "use_bidirectional_attention", False):
        raise NotImplementedError(
            f"{cfg.model_type} is configured for bidirectional attention; kvtax is causal only"
        )
    family = cfg.model_type
    if warn_untested and family not in TESTED_FAMILIES:
        warnings.warn(
            f"kvtax.hf has not been tested with model family {family!r} (tested: "
            f"{', '.join(sorted(TESTED_FAMILIES))}); compare its outputs with DynamicCache "
            "before trusting them",
            UserWarning,
            stacklevel=2,
        )
    previous = model.config._attn_implementation
    register()
    try:
        model.set_attn_implementation(ATTN_NAME)
    except Exception:
        unregister()
        raise
    if model.config._attn_implementation != ATTN_NAME:
        unregister()
        raise RuntimeError(
            f"{type(model).__name__} did not accept attn_implementation={ATTN_NAME!r} "
            "(it does not dispatch attention through transformers' AttentionInterface)"
        )
    setattr(model, _PREVIOUS_ATTR, previous)
    return model


def uninstall(model: PreTrainedModel) -> PreTrainedModel:
    """Put back the attention implementation `install` replaced; returns the model."""
    if not is_installed(model):
        raise RuntimeError("kvtax is not installed on this model")
    previous = getattr(model, _PREVIOUS_ATTR)
    model.set_attn_implementation(previous)
    delattr(model, _PREVIOUS_ATTR)
    unregister()
    return model


@contextmanager
def installed(model: PreTrainedModel, *, warn_untested: bool = True) -> Iterator[PreTrainedModel]:
    """`with installed(model): ...` runs the block with the kvtax attention installed."""
    install(model, warn_untested=warn_untested)
    try:
        yield model
    finally:
        uninstall(model)
