"""4-bit per-channel key codes over 64-token blocks: MSE of min/max ranges (q4's int4-c64)
against a least-squares fit of scale and bias (4 alternations) and a searched clipped range,
per layer on one forward's post-RoPE keys. python fit.py MODEL.gguf TOKENS"""
import torch
from keys import layer_keys
keys = layer_keys()
L = 15
def minmax(g):  # g [..., 64, D] over dim -2
    lo, hi = g.amin(-2, keepdim=True), g.amax(-2, keepdim=True)
    s = ((hi - lo) / L).clamp_min(1e-8)
    c = ((g - lo) / s).round().clamp(0, L)
    return c * s + lo, c, s, lo
def lsq(g, iters=4):
    r, c, s, b = minmax(g)
    for _ in range(iters):
        cm, gm = c.mean(-2, keepdim=True), g.mean(-2, keepdim=True)
        var = (c - cm).pow(2).mean(-2, keepdim=True)
        s2 = ((c - cm) * (g - gm)).mean(-2, keepdim=True) / var.clamp_min(1e-8)
        s2 = torch.where(var > 0, s2, s).clamp_min(1e-8)
        b2 = gm - s2 * cm
        c2 = ((g - b2) / s2).round().clamp(0, L)
        better = ((c2 * s2 + b2 - g).pow(2).sum(-2, keepdim=True) < (c * s + b - g).pow(2).sum(-2, keepdim=True))
        s, b, c = torch.where(better, s2, s), torch.where(better, b2, b), torch.where(better, c2, c)
    return c * s + b
def clip(g):
    best = minmax(g)[0]; be = (best - g).pow(2).sum(-2, keepdim=True)
    lo, hi = g.amin(-2, keepdim=True), g.amax(-2, keepdim=True)
    mid = (lo + hi) / 2
    for a in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7):
        for sh in (-0.1, 0, 0.1):
            l2 = mid + (lo - mid) * a + sh * (hi - lo) * (1 - a); h2 = mid + (hi - mid) * a + sh * (hi - lo) * (1 - a)
            s = ((h2 - l2) / L).clamp_min(1e-8)
            r = ((g - l2) / s).round().clamp(0, L) * s + l2
            e = (r - g).pow(2).sum(-2, keepdim=True)
            best = torch.where(e < be, r, best); be = torch.minimum(e, be)
    return best
tot = [0, 0, 0]
for i, k in enumerate(keys):  # k [1, H, T, D]
    T = k.shape[-2] // 64 * 64
    g = k[..., :T, :].unflatten(-2, (-1, 64))
    es = [(f(g) - g).pow(2).mean().item() for f in (lambda g: minmax(g)[0], lsq, clip)]
    tot = [a + b for a, b in zip(tot, es)]
    print(f"L{i:2d} mse minmax {es[0]:.4f} lsq {es[1]/es[0]:.3f}x clip {es[2]/es[0]:.3f}x")
print("all", tot[1] / tot[0], tot[2] / tot[0])
