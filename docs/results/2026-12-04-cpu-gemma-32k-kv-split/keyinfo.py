"""What more information per key buys: 4-bit per-channel key MSE over 64-token blocks
(q4's int4-c64) against finer blocks, a few exact outliers per channel block, a
non-uniform 16-level grid and 5-bit codes, with each one's bits per key element
(metadata included)."""
import torch

from capture import forward


def block_codes(k: torch.Tensor, block: int, outliers: int = 0, grid: torch.Tensor | None = None,
                levels: int = 15):
    """k `[1, H, T, D]` (T a multiple of block) → its reconstruction: per channel per
    block, min/max affine codes of `levels` steps (or `grid`, 16 levels in [0, 1]); the `outliers`
    values farthest from the block's median are kept exact and left out of the range."""
    _, h, t, d = k.shape
    x = k[0].reshape(h, t // block, block, d)
    keep = torch.zeros_like(x, dtype=torch.bool)
    if outliers:
        dev = (x - x.median(2, keepdim=True).values).abs()
        keep.scatter_(2, dev.topk(outliers, dim=2).indices, True)
    lo = torch.where(keep, torch.inf, x).amin(2, keepdim=True)
    hi = torch.where(keep, -torch.inf, x).amax(2, keepdim=True)
    scale = (hi - lo).clamp_min(1e-8)
    u = ((x - lo) / scale).clamp(0, 1)
    if grid is None:
        q = torch.round(u * levels) / levels
    else:
        q = grid[(u[..., None] - grid).abs().argmin(-1)]
    y = torch.where(keep, x, q * scale + lo)
    return y.reshape(1, h, t, d)


def lloyd(k: torch.Tensor, block: int = 64, iters: int = 30) -> torch.Tensor:
    """16 levels in [0, 1] fitted (Lloyd-Max) to this layer's keys, each channel block
    normalized by its own min/max: what a per-layer codebook could hold."""
    _, h, t, d = k.shape
    x = k[0].reshape(h, t // block, block, d)
    lo, hi = x.amin(2, keepdim=True), x.amax(2, keepdim=True)
    u = ((x - lo) / (hi - lo).clamp_min(1e-8)).flatten()
    grid = torch.linspace(0, 1, 16)
    for _ in range(iters):
        idx = (u[:, None] - grid).abs().argmin(1)
        sums = torch.zeros(16).index_add_(0, idx, u)
        counts = torch.zeros(16).index_add_(0, idx, torch.ones_like(u))
        grid = torch.where(counts > 0, sums / counts.clamp_min(1), grid)
        grid[0], grid[-1] = 0.0, 1.0  # the block's min and max stay exact
    return grid


model, keys, _ = forward()
types = getattr(model.config, "layer_types", None) or ["full_attention"] * len(keys)
arms = [("c64 (q4)", 4.5, dict(block=64)), ("c32", 5.0, dict(block=32)),
        ("c16", 6.0, dict(block=16)), ("c64 + 1 outlier", 4.84, dict(block=64, outliers=1)),
        ("c64 + 2 outliers", 5.19, dict(block=64, outliers=2)), ("c64 codebook", 4.5, None),
        ("c64 5-bit", 5.5, dict(block=64, levels=31))]
print("bits per key element: " + ", ".join(f"{n} {b}" for n, b, _ in arms))
print("layer | attention | " + " | ".join(n for n, _, _ in arms[1:]) + "  (MSE / c64's)")
for i, k in enumerate(keys):
    base = (block_codes(k, 64) - k).pow(2).mean()
    ratios = []
    for _, _, kw in arms[1:]:
        y = block_codes(k, 64, grid=lloyd(k)) if kw is None else block_codes(k, **kw)
        ratios.append(((y - k).pow(2).mean() / base).item())
    print(i, types[i], *(f"{r:.3f}" for r in ratios), sep=" | ")
