"""int4-c64 key codes rounded to nearest (q4's) or to minimize the error of the scores
q·k (GPTQ's update: channel by channel, each rounding error fed forward to the channels
not yet rounded, under H = E[q qᵀ] of the layer's queries), and the attention error either
causes. Blocks' scales and biases are q4's (per channel min/max over 64 tokens) in both."""
import torch


def grid(k: torch.Tensor, block: int = 64, levels: int = 15):
    """k `[T, D]` → per-token bias and scale `[T, D]` of its 64-token blocks."""
    t, d = k.shape
    x = k.reshape(t // block, block, d)
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    s = ((hi - lo) / levels).clamp_min(1e-8)
    return lo.expand_as(x).reshape(t, d), s.expand_as(x).reshape(t, d)


def nearest(k: torch.Tensor, levels: int = 15) -> torch.Tensor:
    lo, s = grid(k, levels=levels)
    return torch.round((k - lo) / s).clamp(0, levels) * s + lo


def factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """h `[..., D, D]` float64 → GPTQ's upper Cholesky factor of (h + damp · mean diag · I)⁻¹."""
    d = h.shape[-1]
    h = h + damp * h.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(d, dtype=h.dtype)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def round_forward(x: torch.Tensor, lo: torch.Tensor, s: torch.Tensor, u: torch.Tensor,
                  levels: int) -> torch.Tensor:
    """Codes `[..., T, D]` (float64) of x on the grid lo + s · c, c in [0, levels] (x, lo, s
    `[..., T, D]` float64), channel by channel, each channel's rounding error fed forward to
    the channels after it under u `[..., D, D]` (`factor`)."""
    w = x.clone()
    codes = torch.empty_like(w)
    for i in range(w.shape[-1]):
        c = ((w[..., i] - lo[..., i]) / s[..., i]).round().clamp(0, levels)
        codes[..., i] = c
        e = (w[..., i] - (c * s[..., i] + lo[..., i])) / u[..., i, i, None]
        w[..., i + 1:] -= e[..., None] * u[..., i, None, i + 1:]
    return codes


def weighted(k: torch.Tensor, h: torch.Tensor, levels: int = 15, damp: float = 0.01,
             order: str | None = None) -> torch.Tensor:
    """k `[T, D]` rounded under h `[D, D]` (float64), damped by `damp` of its mean diagonal;
    order "act": channels with the largest query energy first."""
    lo, s = grid(k, levels=levels)
    perm = torch.argsort(h.diag(), descending=True) if order == "act" else torch.arange(k.shape[1])
    lo, s = lo[:, perm].double(), s[:, perm].double()
    c = round_forward(k[:, perm].double(), lo, s, factor(h[perm][:, perm], damp), levels)
    res = torch.empty_like(c)
    res[:, perm] = c * s + lo
    return res.float()


def gram(q: torch.Tensor) -> torch.Tensor:
    """Queries `[..., D]` → E[q qᵀ] `[D, D]` float64."""
    q = q.reshape(-1, q.shape[-1]).double()
    return q.T @ q / q.shape[0]


def attention_error(q, k, kh, v, scaling, first: int):
    """Queries at positions >= first (q `[Hq, T, D]`; k, kh, v `[T, D]`, causal): mean relative
    attention-output error and the mean squared score error over the keys each sees."""
    t = k.shape[0]
    mask = torch.ones(t, t).tril().bool()[first:]
    qq = q[:, first:]
    s = ((qq @ k.T) * scaling).masked_fill(~mask, -torch.inf)
    sh = ((qq @ kh.T) * scaling).masked_fill(~mask, -torch.inf)
    o, oh = torch.softmax(s, -1) @ v, torch.softmax(sh, -1) @ v
    return ((o - oh).norm(dim=-1) / o.norm(dim=-1)).mean().item(), (s - sh)[:, mask].pow(2).mean().item()
