"""The attention paths kvtax is measured against, as functions over a `CacheView`.

All take `(q, view, *, scale=None, softcap=None, causal=True)` like `kvtax.attention`,
with q `[B, H_q, L, D]` (the last L positions) and return `[B, H_q, L, D]` in q.dtype:

- `attention_unfused`: mlx-lm's quantized path (`quantized_scaled_dot_product_attention`):
  scores `[B, H_q, L, ctx]` materialized in the model dtype, softmax, then a second
  matmul. The transient grows with chunk x context (1.216 GB of it measured at a 2048-token
  chunk over a long prompt).
- `attention_dequant`: transformers' QuantizedCache: dequantize the whole cache to the
  model dtype on every call, then `scaled_dot_product_attention`.
- `attention_sdpa`: the stock fp16 baseline: SDPA straight over unquantized storage.

Two forms of each, one function: eager (`view.length_t` None) they read the first
`view.num_slots` slots with a mask from the host length, as today's libraries do. In a
captured CUDA-graph decode step (`view.length_t` set: `kvtax.models.Runner`) they read
every physical slot of the presized storage behind a mask computed on the device
(`kvtax.attention.masks`), so one graph serves every step: the same semantics (dequantize
everything, materialize every score) over the same ~bytes. Each function carries
`graph_blocker(q, view)`, which the runner asks before capturing it.

    >>> from kvtax.attention.baselines import ATTENTION_PATHS
    >>> out = ATTENTION_PATHS["unfused"](q, cache.view())
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvtax.attention import CacheView, attention
from kvtax.attention.checks import check_query, rotate_query, unrotate_output
from kvtax.formats import FloatFormat, QTensor
from kvtax.attention.masks import capacity_mask, host_mask, storage_slots

AttentionFn = Callable[..., torch.Tensor]


def _slots(view: CacheView) -> int:
    """Slots a call reads: the held ones eager, every physical one in a captured step."""
    return view.num_slots if view.length_t is None else storage_slots(view)


def _dequantized(part: QTensor, fmt, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first n slots of one K or V storage, decoded to `dtype` (a fresh tensor)."""
    return fmt.read(part, 0, n, dtype)


def attention_unfused(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """mlx-lm's composition: decode K, scores = q·Kᵀ materialized, softmax, scores·V.

    Like mlx-lm, queries are grouped per KV head (no K/V repeat) and the scores live in
    the model dtype, softmax accumulated in float32 (`precise=True`). Memory: the full
    `[B, H_q, L, slots]` score tensor plus the decoded K and V.
    """
    n_q, group = check_query(q, view)
    b, hq, _, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    n = _slots(view)
    k = _dequantized(view.k, view.spec.key, n, q.dtype)       # [B, Hkv, n, D]
    v = _dequantized(view.v, view.spec.value, n, q.dtype)
    qg = (rotate_query(q, view) * scale).view(b, view.num_kv_heads, group, n_q, d)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2))  # [B, Hkv, G, L, n]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if view.length_t is None:
        mask = host_mask(n_q, view, causal)                   # [L, n] or None
    else:
        mask = capacity_mask(n_q, view, causal)[:, :, None]   # [B, 1, 1, L, n]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # mlx-lm's precise softmax: float32 inside, the model dtype out (torch's half softmax
    # accumulates in float32 too); no float32 copy of the scores is materialized.
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.unsqueeze(2))                    # [B, Hkv, G, L, D]
    return unrotate_output(out.reshape(b, hq, n_q, d), view)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    view: CacheView,
    scale: float | None,
    softcap: float | None,
    causal: bool,
    fold_gqa: bool = False,
    lower_right: bool = False,
) -> torch.Tensor:
    """SDPA of q `[B, H_q, L, D]` over k, v `[B, H_kv, n, D]` (n = `_slots(view)`)."""
    if softcap:
        raise NotImplementedError(
            "torch SDPA has no logit soft-capping; this baseline cannot run a softcap model "
            "(use the fused or unfused path)"
        )
    args, kw = sdpa_arguments(q, k, v, view, scale, causal, fold_gqa, lower_right)
    return F.scaled_dot_product_attention(*args, **kw).reshape(q.shape)


def sdpa_arguments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    view: CacheView,
    scale: float | None,
    causal: bool,
    fold_gqa: bool = False,
    lower_right: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], dict]:
    """The exact ((q, k, v), kwargs) the baselines hand `F.scaled_dot_product_attention`.

    Eager: q as given, GQA by `enable_gqa`, the host mask (None for plain decode, which
    lets SDPA pick flash). Captured (`view.length_t` set): the query heads kept, GQA by
    `enable_gqa`, under one additive mask `[B, 1, L, slots]` from the device lengths.
    `fold_gqa=True` instead folds each KV head's G query heads into G·L query rows
    `[B, H_kv, G·L, D]` under a mask `[B, 1, G·L, slots]` (every backend serves it, each KV
    head read once) — measured 1.6-11x slower on an H200 with cuDNN (Llama-3.1-8B shapes,
    2026-12-01, `benchmarks/stock_check.py`: 6.80 / 24.9 / 87.1 ms per token at 4k / 32k /
    128k against 4.36 / 5.15 / 7.97 heads kept), so the kept heads are the default.
    `lower_right=True` (eager, a causal chunk over a full cache) passes the mask as torch's
    lower-right causal bias instead of a bool tensor: the form the flash backend serves.
    """
    gqa = q.shape[1] != k.shape[1]
    n_q = q.shape[2]
    if view.length_t is None:
        if lower_right and causal and n_q > 1 and view.window is None and not view.ring:
            from torch.nn.attention.bias import causal_lower_right

            bias = causal_lower_right(n_q, k.shape[2])
            return (q, k, v), dict(attn_mask=bias, scale=scale, enable_gqa=gqa)
        mask = host_mask(n_q, view, causal)
        if mask is not None:
            mask = mask.to(q.device)
        return (q, k, v), dict(attn_mask=mask, scale=scale, enable_gqa=gqa)
    if not fold_gqa:
        mask = capacity_mask(q.shape[2], view, causal, dtype=q.dtype)
        return (q, k, v), dict(attn_mask=mask, scale=scale, enable_gqa=gqa)
    b, hq, n_q, d = q.shape
    group = hq // k.shape[1]
    mask = capacity_mask(n_q, view, causal, repeat=group, dtype=q.dtype)  # built once a step
    return (q.reshape(b, k.shape[1], group * n_q, d), k, v), dict(attn_mask=mask, scale=scale)


def attention_dequant(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    lower_right: bool = False,
) -> torch.Tensor:
    """transformers QuantizedCache's way: decode the whole cache every call, then SDPA.

    The decoded copy `[B, H_kv, slots, D]` x 2 in the model dtype is allocated per call,
    which is exactly the traffic and transient a fused kernel avoids. lower_right: see
    `sdpa_arguments` (benchmarks/attention.py times this path under the flash backend).
    """
    check_query(q, view)
    n = _slots(view)
    k = _dequantized(view.k, view.spec.key, n, q.dtype)
    v = _dequantized(view.v, view.spec.value, n, q.dtype)
    out = _sdpa(rotate_query(q, view), k, v, view, scale, softcap, causal,
                lower_right=lower_right)
    return unrotate_output(out, view)


def attention_sdpa(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    fold_gqa: bool = False,
    lower_right: bool = False,
) -> torch.Tensor:
    """The fp16 baseline: SDPA reads the unquantized storage in place (no decode copy).

    The query is cast to the storage dtype (a few KB) rather than the cache to the
    query's, so an fp16 cache under an fp32 CPU model is still read without a copy.
    fold_gqa: the captured form's GQA (`sdpa_arguments`); `attention_sdpa_folded` is True.
    lower_right: an eager causal chunk's mask as torch's lower-right bias (`sdpa_arguments`).
    """
    check_query(q, view)
    if (reason := _not_float(view)) is not None:
        raise ValueError(reason)
    k, v = sdpa_storage(view)
    out = _sdpa(rotate_query(q, view).to(k.dtype), k, v, view, scale, softcap, causal,
                fold_gqa, lower_right)
    return unrotate_output(out.to(q.dtype), view)


def sdpa_storage(view: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16 path's K and V: the unquantized storage `[B, H_kv, n, D]`, no copy."""
    n = _slots(view)
    return view.k.codes[:, :, :n], view.v.codes[:, :, :n].to(view.k.codes.dtype)


def _not_float(view: CacheView) -> str | None:
    if isinstance(view.spec.key, FloatFormat) and isinstance(view.spec.value, FloatFormat):
        return None
    return (f"the fp16 path needs an unquantized cache, got {view.spec.name}; "
            "use the dequant path for quantized formats")


def _view_blocker(q: torch.Tensor, view: object) -> str | None:
    """Why a captured step cannot run this baseline over `view` (None: it can)."""
    if not isinstance(view, CacheView):
        return f"the baselines read a CacheView, not a {type(view).__name__}"
    return None


def _sdpa_blocker(q: torch.Tensor, view: object) -> str | None:
    return _view_blocker(q, view) or _not_float(view)  # type: ignore[arg-type]


# The protocol `kvtax.models.Runner` asks before capturing a decode step: a function that
# reads lengths from `view.length_t` says which calls it can serve inside a CUDA graph.
attention_unfused.graph_blocker = _view_blocker  # type: ignore[attr-defined]
attention_dequant.graph_blocker = _view_blocker  # type: ignore[attr-defined]
attention_sdpa.graph_blocker = _sdpa_blocker  # type: ignore[attr-defined]
# The stock call with GQA folded into query rows: measured slower, kept for stock_check.py.
attention_sdpa_folded = functools.partial(attention_sdpa, fold_gqa=True)
attention_sdpa_folded.graph_blocker = _sdpa_blocker  # type: ignore[attr-defined]

_BACKEND_NAMES = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
                  "CUDNN_ATTENTION": "cudnn", "MATH": "math", "OVERRIDEABLE": "overrideable"}


def sdpa_backend(
    path: str, q: torch.Tensor, view: CacheView, fold_gqa: bool = True
) -> str | None:
    """The SDPA backend ("flash", "efficient", "cudnn", "math") the `path` baseline's call
    for q `[B, H_q, L, D]` over `view` dispatches to under the backends enabled now (the
    captured form when `view.length_t` is set); None for paths that call no SDPA.

    Asks torch's own dispatcher (`torch._fused_sdp_choice`) with the call's exact
    arguments; dequant's decoded K/V are stand-ins of their shape (allocated, not filled).
    """
    if path not in ("fp16", "dequant"):
        return None
    if path == "fp16":
        k, v = sdpa_storage(view)
        q = q.to(k.dtype)
    else:
        n = _slots(view)
        shape = (view.batch, view.num_kv_heads, n, view.head_dim)
        k = v = torch.empty(shape, dtype=q.dtype, device=q.device)
    args, kw = sdpa_arguments(q, k, v, view, None, True, fold_gqa)
    choice = getattr(torch, "_fused_sdp_choice", None)
    if choice is None:
        return "unknown"
    try:
        from torch.nn.attention import SDPBackend

        name = SDPBackend(choice(*args, **kw)).name
    except (RuntimeError, ValueError):  # no backend serves the call: SDPA itself raises
        return "none"
    except TypeError:  # a torch whose dispatcher query takes other arguments
        return "unknown"
    return _BACKEND_NAMES.get(name, name.lower())


ATTENTION_PATHS: dict[str, AttentionFn] = {
    "fused": attention,  # kvtax's own: Triton kernels on CUDA, blockwise reference on CPU
    "fp16": attention_sdpa,
    "unfused": attention_unfused,
    "dequant": attention_dequant,
}


def attention_for(path: str) -> AttentionFn:
    """The attention function of a path name; hf-quantized is not a view function."""
    try:
        return ATTENTION_PATHS[path]
    except KeyError:
        raise ValueError(
            f"path {path!r} has no CacheView attention function "
            f"(known: {', '.join(ATTENTION_PATHS)}; hf-quantized runs transformers' own cache)"
        ) from None
