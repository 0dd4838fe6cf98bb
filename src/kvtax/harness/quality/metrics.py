"""The numbers `kvtax quality` reports, from logits and attention outputs.

Next-token metrics compare a quantized-KV run with the fp16-KV run of the same model on
the same tokens (teacher forced):
  - KL(p_fp16 || p_quant) per position, `sum_v p(v) (log p(v) - log q(v))`, in nats;
  - top-1 agreement: the two argmax tokens are equal;
  - negative log-likelihood of the text's actual next token (perplexity = exp(mean NLL)).
Attention error per layer: ||o_quant - o_fp16|| / ||o_fp16|| over the scored queries,
where both outputs use the same q and the same K/V, read from the measured cache and from
an fp16 shadow of it (`LayerErrorProbe`), so a layer's number is its own quantization
error, not error carried in from earlier layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtax.attention import attention


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """`[T, V]` logits → float32 log-probabilities `[T, V]`."""
    return torch.log_softmax(logits.float(), dim=-1)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """NLL (nats) of `targets` `[T]` under `logits` `[T, V]`; float64 `[T]`."""
    lf = logits.float()
    picked = lf.gather(-1, targets.view(-1, 1)).squeeze(-1)
    return (torch.logsumexp(lf, dim=-1) - picked).double()


def kl_divergence(logp_ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row of log-probabilities `[T, V]`; float64 `[T]`, in nats.

    Terms where the reference has zero probability contribute 0 (0 · log 0 = 0).
    """
    p_ref, lr, lo = logp_ref.double().exp(), logp_ref.double(), logp.double()
    terms = torch.where(p_ref > 0, p_ref * (lr - lo), torch.zeros_like(lr))
    return terms.sum(-1).clamp_min(0.0)  # rounding can leave -1e-17 on identical rows


def top1_agree(logp_ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Bool `[T]`: do both distributions put their mode on the same token?"""
    return logp_ref.argmax(-1) == logp.argmax(-1)


@dataclass
class TailStats:
    """Per-position numbers over a pass's scored tail, and NLL over every position."""

    kl: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)
    tail_nll: list[float] = field(default_factory=list)
    full_nll_sum: float = 0.0
    full_count: int = 0

    def summary(self) -> dict[str, Any]:
        """Means and spreads: kl (mean), kl_max, kl_median, kl_sem, top1, ppl, ppl_full."""
        n = len(self.tail_nll)
        out: dict[str, Any] = {"tokens_scored": n}
        if self.kl:
            kl = torch.tensor(self.kl, dtype=torch.float64)
            out.update(
                kl=float(kl.mean()), kl_max=float(kl.max()), kl_median=float(kl.median()),
                kl_sem=float(kl.std() / math.sqrt(len(kl))) if len(kl) > 1 else 0.0,
                top1=sum(self.agree) / len(self.agree),
            )
        out["nll"] = sum(self.tail_nll) / n if n else None
        out["ppl"] = math.exp(out["nll"]) if n else None
        out["ppl_full"] = (math.exp(self.full_nll_sum / self.full_count)
                           if self.full_count else None)
        return out


class LayerErrorProbe:
    """Measures each layer's attention error against an fp16 shadow of its own cache.

    Use as a context manager around a pass: it sets every layer's `attn_fn` to one that
    runs the layer's real attention (`attention`, which also serves hybrid views)
    and, for queries at positions >= `tail_start`, attention over `shadows[i]` (an fp16
    cache fed the same K/V through `tee`) with the same q; on exit the original
    `attn_fn`s are back. `shadows=None` measures nothing (the baseline pass).

        probe = LayerErrorProbe(model, shadows, tail_start)
        with probe:
            model(ids, probe.tee(caches), pos, last_only=False)
        probe.layer_errors()   # [num_layers] relative errors
    """

    def __init__(self, model: Any, shadows: Sequence[Any] | None, tail_start: int):
        self.model, self.shadows, self.tail_start = model, shadows, tail_start
        n = len(model.layers)
        self.err2: list[torch.Tensor | None] = [None] * n
        self.ref2: list[torch.Tensor | None] = [None] * n
        self._saved: list[Callable] = []
        self._caches: Sequence[Any] = []

    def tee(self, caches: Sequence[Any]) -> list[Any]:
        """The caches the model should be handed: each also feeds its shadow."""
        self._caches = caches
        if self.shadows is None:
            return list(caches)
        return [_Tee(c, s) for c, s in zip(caches, self.shadows)]

    def __enter__(self) -> "LayerErrorProbe":
        self._saved = [layer.attn.attn_fn for layer in self.model.layers]
        for i, layer in enumerate(self.model.layers):
            layer.attn.attn_fn = self._attn_fn(i)
        return self

    def __exit__(self, *exc: object) -> None:
        for layer, fn in zip(self.model.layers, self._saved):
            layer.attn.attn_fn = fn

    def _attn_fn(self, i: int) -> Callable:
        def fn(q: torch.Tensor, view: Any, **kw: Any) -> torch.Tensor:
            out = attention(q, view, **kw)
            if self.shadows is None:
                return out
            length = view.length
            m = min(q.shape[2], length - max(self.tail_start, length - q.shape[2]))
            if m > 0:
                ref = attention(q[:, :, -m:], self.shadows[i].view(), **kw).float()
                diff = out[:, :, -m:].float() - ref
                self._add(i, diff.pow(2).sum((0, 2, 3)), ref.pow(2).sum((0, 2, 3)))
            return out

        return fn

    def _add(self, i: int, e2: torch.Tensor, r2: torch.Tensor) -> None:
        e, r = self.err2[i], self.ref2[i]
        self.err2[i] = e2.double() if e is None else e + e2.double()
        self.ref2[i] = r2.double() if r is None else r + r2.double()

    def layer_errors(self) -> list[float | None]:
        """Per layer: sqrt(sum over heads of error²) / sqrt(sum of reference²)."""
        return [None if e is None or r is None
                else float(e.sum().sqrt() / r.sum().sqrt().clamp_min(1e-30))
                for e, r in zip(self.err2, self.ref2)]

    def head_errors(self) -> list[list[float] | None]:
        """Per layer, per query head: ||o_quant - o_fp16|| / ||o_fp16||."""
        return [None if e is None or r is None
                else (e.sqrt() / r.sqrt().clamp_min(1e-30)).tolist()
                for e, r in zip(self.err2, self.ref2)]


class _Tee:
    """A cache that also feeds every appended chunk to an fp16 shadow cache."""

    def __init__(self, cache: Any, shadow: Any):
        self.cache, self.shadow = cache, shadow

    @property
    def length(self) -> int:
        return self.cache.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.append(k, v)
        self.shadow.append(k, v)

    def view(self) -> Any:
        return self.cache.view()


def ppl_deltas(summary: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """A row's perplexity fields against the baseline's (`ppl_base`, `ppl_delta`, and the
    same over all positions, `ppl_full_*`); all None without a baseline."""
    out: dict[str, Any] = {"ppl_base": None, "ppl_delta": None, "ppl_full_base": None,
                           "ppl_full_delta": None}
    if base is None:
        return out
    for key in ("ppl", "ppl_full"):
        if summary.get(key) is not None and base.get(key) is not None:
            out[f"{key}_base"] = base[key]
            out[f"{key}_delta"] = summary[key] - base[key]
    return out
