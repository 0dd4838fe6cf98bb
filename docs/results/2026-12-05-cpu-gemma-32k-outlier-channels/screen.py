"""Per global layer: the attention error of int4-c64 keys (q4's) when some channels of
each 64-token block get more bits, chosen by the block's per-channel range (no queries,
no calibration). Values exact; queries at positions >= EVAL; averaged over KV heads.
python screen.py model.gguf TOKENS EVAL [FRACTIONS]"""
import sys

import torch

sys.path.insert(0, "../2026-12-04-cpu-gemma-32k-key-bits")
from capture import run  # noqa: E402
from rounding import attention_error  # noqa: E402


def blockwise(k: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """k `[T, D]` rounded to nearest on its 64-token blocks' per-channel min/max grid with
    bits `[T/64, D]` per block and channel."""
    t, d = k.shape
    levels = (2.0 ** bits - 1).repeat_interleave(64, 0)  # [T, D]
    x = k.reshape(t // 64, 64, d)
    lo = x.amin(1, keepdim=True).expand_as(x).reshape(t, d)
    hi = x.amax(1, keepdim=True).expand_as(x).reshape(t, d)
    s = ((hi - lo) / levels).clamp_min(1e-8)
    return torch.round((k - lo) / s).clamp(min=0).minimum(levels) * s + lo


def ranges(k: torch.Tensor) -> torch.Tensor:
    x = k.reshape(k.shape[0] // 64, 64, -1)
    return x.amax(1) - x.amin(1)  # [T/64, D]


def top(k, r, hi, base=4, fixed=False):
    """base bits, `hi` bits on the r widest channels of each block (fixed: of block 0)."""
    rg = ranges(k)
    if fixed:
        rg = rg[:1].expand_as(rg)
    bits = torch.full_like(rg, float(base))
    idx = rg.topk(r, dim=-1).indices
    bits.scatter_(-1, idx, float(hi))
    return blockwise(k, bits)


def waterfill(k, avg=4.0, lo=2, hi=8):
    """Integer bits per channel from the block's ranges (reverse water-filling under the
    range² error model), mean `avg` bits per block."""
    rg = ranges(k).clamp_min(1e-6)
    nb, d = rg.shape
    ideal = avg + torch.log2(rg) - torch.log2(rg).mean(-1, keepdim=True)
    bits = ideal.round().clamp(lo, hi)
    # fix the sum per block to avg * d: move single bits by largest rounding residue
    for b in range(nb):
        diff = int(bits[b].sum().item() - avg * d)
        res = ideal[b] - bits[b]
        while diff != 0:
            if diff > 0:
                cand = torch.where(bits[b] > lo, res, torch.full_like(res, float("inf")))
                i = cand.argmin(); bits[b, i] -= 1; res[i] += 1; diff -= 1
            else:
                cand = torch.where(bits[b] < hi, res, torch.full_like(res, -float("inf")))
                i = cand.argmax(); bits[b, i] += 1; res[i] -= 1; diff += 1
    return blockwise(k, bits)


path, n, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, types, rec = run(path, n)
D = next(iter(rec.values()))[1].shape[-1]


def uniform(k, b):
    return blockwise(k, torch.full_like(ranges(k), float(b)))


arms = {"k4": lambda k: uniform(k, 4), "k5": lambda k: uniform(k, 5)}
FRACS = [float(f) for f in (sys.argv[4] if len(sys.argv) > 4 else
                            "0.03125,0.0625,0.125,0.25,0.5").split(",")]
for f in FRACS:  # a fifth bit on this fraction of each block's channels, the widest
    arms[f"+1b top {f:g}"] = (lambda r: lambda k: top(k, r, 5))(round(f * D))
if len(sys.argv) > 4:  # the same channels for the whole sequence: block 0's widest
    for f in FRACS:
        arms[f"+1b top {f:g} fixed"] = (lambda r: lambda k: top(k, r, 5, fixed=True))(round(f * D))
else:
    for f in FRACS[:3]:  # int8 on the widest channels
        arms[f"8b top {f:g}"] = (lambda r: lambda k: top(k, r, 8))(round(f * D))
    arms["+1b top 0.125 fixed"] = lambda k: top(k, D // 8, 5, fixed=True)
    arms["8b top 0.0625 fixed"] = lambda k: top(k, D // 16, 8, fixed=True)
    arms["wf avg4"] = lambda k: waterfill(k, 4.0)
    arms["wf avg4.25"] = lambda k: waterfill(k, 4.25)
print(f"{path.rsplit('/', 1)[1]}, {n} tokens, head_dim {D}, errors over queries >= {first}: "
      "relative attention-output error / score MSE (values exact)")
print("arm | " + " | ".join(
    f"L{i}" for i in sorted(rec) if types[i] == "full_attention"))
res = {a: [] for a in arms}
for i, (q, k, v, sc) in sorted(rec.items()):
    if types[i] != "full_attention":
        continue
    q, k, v = q[0], k[0], v[0]
    g = q.shape[0] // k.shape[0]
    for a, f in arms.items():
        e = m = 0.0
        for h in range(k.shape[0]):
            r = attention_error(q[h * g:(h + 1) * g], k[h], f(k[h]), v[h], sc, first)
            e += r[0] / k.shape[0]; m += r[1] / k.shape[0]
        res[a].append(f"{e:.4f} {m:.3g}")
for a in arms:
    print(a, *res[a], sep=" | ", flush=True)
