"""The attention function and mask function transformers calls for a `KVTaxCache`.

transformers looks both up by the model's `config._attn_implementation`:

- the *mask function* (AttentionMaskInterface) turns the 2D padding mask into what the
  attention function receives. Here it returns None when no row is padded, else a bool
  key-validity mask `[B, 1, 1, P]` over absolute positions — never a `[B, 1, Q, K]`
  score mask. Causality and sliding windows are not encoded: the kvtax cache view
  applies them. Outside `torch.compile` it checks that the model asks for exactly the
  causal (or sliding-window causal) pattern and that padding is left padding.
- the *attention function* (AttentionInterface) receives `KVHandle`s as key and value
  (what `KVTaxLayer.update` returned) and runs `kvtax.attention.attention` on the
  layer's quantized storage: fused kernels on CUDA, the blockwise reference elsewhere.
  It never dequantizes the whole cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvtax.hf.layers import KVHandle

ATTN_NAME = "kvtax"
_PROBE_ROWS = 32  # query rows a mask pattern is checked on (evenly spread)
_PROBE_KEYS = 64  # keys probed at the start, before each probed row, and x4 evenly spread
_ALL_KEYS = 2048  # spans up to this many keys are probed on every key


def kvtax_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: KVHandle,
    value: KVHandle,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention over a kvtax layer.

    query:          `[B, H_q, T, D]`, the T new tokens' queries (after RoPE).
    key, value:     the `KVHandle` that `KVTaxCache.update` returned for this layer.
    attention_mask: None, or a bool key-validity mask `[B, 1, 1, P]` (left padding).
    Returns (`[B, T, H_q, D]` contiguous, None): attention weights are never formed.
    """
    if not isinstance(key, KVHandle):
        raise TypeError(
            "the kvtax attention reads a KVTaxCache, but this layer got plain K/V tensors "
            f"({type(key).__name__}). Pass `past_key_values=KVTaxCache(model.config, kv=...)` "
            "to generate/forward, or `kvtax.hf.uninstall(model)` to run with another cache"
        )
    if module.training and dropout:
        raise NotImplementedError("the kvtax attention is for inference; call model.eval()")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise NotImplementedError("the kvtax attention is causal only (bidirectional requested)")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("learned attention-sink logits (s_aux) are not supported")
    layer = key.layer
    if (sliding_window or None) != layer.window:
        raise ValueError(
            f"the model attends layer {getattr(module, 'layer_idx', '?')} with sliding window "
            f"{sliding_window} but its KVTaxCache layer has window {layer.window}; build the "
            "cache from this model's config: KVTaxCache(model.config, ...)"
        )
    out = layer.attend(query, scale=scaling, softcap=softcap, kv_start=_kv_start(attention_mask))
    return out.transpose(1, 2).contiguous(), None


def _kv_start(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Each row's first valid key position `[B]` from a key-validity mask, or None."""
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        raise NotImplementedError(
            f"the kvtax attention takes a 2D padding mask (left padding), got a "
            f"{mask.dtype} mask of shape {tuple(mask.shape)}; custom 4D masks are not supported"
        )
    return mask[:, 0, 0, :].to(torch.int8).argmax(-1)  # first True of each row


def kvtax_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function for AttentionMaskInterface: None, or bool `[B, 1, 1, P]` key validity.

    attention_mask: transformers' 2D padding mask `[B, P]` (P = past + new tokens), or None.
    local_size:     the sliding window when transformers builds a sliding-window mask.
    Raises for patterns kvtax cannot reproduce (bidirectional blocks, chunked attention,
    right or middle padding) instead of silently attending differently.
    """
    if use_vmap:  # transformers sets it exactly when a model overlays or/and mask functions
        raise NotImplementedError(
            "this model overlays a custom mask pattern (e.g. bidirectional attention over "
            "image tokens); the kvtax attention implements causal and sliding-window only"
        )
    eager = not torch.compiler.is_compiling()
    if eager and mask_function is not None:
        # A device-side offset (a layer decoding through device positions) is not read
        # back: that would stall the GPU every step; the probe then uses a stand-in offset.
        offset = q_offset if isinstance(q_offset, int) else None
        _check_pattern(mask_function, q_length, offset, local_size)
    if attention_mask is None:
        return None
    valid = attention_mask.bool()
    if valid.dim() != 2:
        raise NotImplementedError(f"expected a 2D padding mask, got shape {tuple(valid.shape)}")
    if eager:
        if bool(valid.all()):
            return None
        _check_left_padding(valid)
    return valid[:, None, None, :]


def _check_pattern(
    mask_function: Callable, q_length: int, q_offset: int | None, window: int | None
) -> None:
    """Probe the model's mask function on a few query rows against causal(+window).

    q_offset: the first query's position, or None when only the device knows it: mask
    functions are functions of positions, so rows past the window show the same pattern.
    Keys are sampled (`_probe_keys`), so a decode step at 32k costs tens of microseconds,
    not a 32k-key comparison per row.
    """
    if q_offset is None:
        q_offset = (window or 0) + 2 * _PROBE_KEYS
    n_rows = min(q_length, _PROBE_ROWS)
    rows = torch.linspace(0, q_length - 1, n_rows).round().long().unique() + q_offset
    keys = _probe_keys(rows, q_offset + q_length, window)
    qi, ki = rows.view(1, 1, -1, 1), keys.view(1, 1, 1, -1)
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long)
    want = (ki <= qi) if window is None else (ki <= qi) & (qi - ki < window)
    try:
        got = torch.as_tensor(mask_function(zero, zero, qi, ki)).bool().expand_as(want)
    except (IndexError, RuntimeError):  # a mask indexing per-token data (block ids, …)
        got = None
    if got is None or not torch.equal(got, want):
        kind = f"sliding-window (W={window}) causal" if window is not None else "causal"
        raise NotImplementedError(
            f"the model's attention mask is not the plain {kind} pattern the kvtax attention "
            "implements (chunked attention, bidirectional blocks or packed sequences?)"
        )


def _probe_keys(rows: torch.Tensor, n_keys: int, window: int | None) -> torch.Tensor:
    """Key positions to probe rows `[R]` on, sorted, in [0, n_keys): all of them for short
    spans; else the first keys, an even spread, and bands at each row's diagonal and at its
    window edge, where causal, sliding, chunked and bidirectional patterns differ."""
    if n_keys <= _ALL_KEYS:
        return torch.arange(n_keys)
    near = torch.arange(-_PROBE_KEYS, 3)  # the keys just before a row, the row, just after
    parts = [
        torch.arange(_PROBE_KEYS),
        torch.linspace(0, n_keys - 1, 4 * _PROBE_KEYS).round().long(),
        (rows[:, None] + near).flatten(),
    ]
    if window is not None:
        parts.append((rows[:, None] - window + torch.arange(-2, 3)).flatten())
    keys = torch.cat(parts)
    return keys[(keys >= 0) & (keys < n_keys)].unique()


def _check_left_padding(valid: torch.Tensor) -> None:
    """Each row must be False…False True…True: the only padding kv_start can express."""
    if not bool(valid.any(-1).all()):
        raise ValueError("a batch row of the attention mask has no valid token at all")
    start = valid.to(torch.int8).argmax(-1)
    pos = torch.arange(valid.shape[-1], device=valid.device)
    if not torch.equal(pos[None, :] >= start[:, None], valid):
        raise NotImplementedError(
            "the kvtax attention supports left padding only (each row: pads, then tokens); "
            "this attention mask has padding after a valid token. Pad on the left "
            "(tokenizer.padding_side = 'left'), as batched generation needs anyway"
        )
