"""Per layer: attention error of q4's keys rounded to nearest vs under the queries' H,
queries at positions >= EVAL, H from the queries at positions < FIT (or all), averaged
over KV heads. python screen.py model.gguf TOKENS FIT EVAL [full]"""
import sys

from capture import run
from rounding import attention_error, gram, nearest, weighted

path, n, fit, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
only_full = sys.argv[5:] == ["full"]
model, types, rec = run(path, n)
arms = {"nearest": lambda k, h, ha: nearest(k),
        "H all d0.01": lambda k, h, ha: weighted(k, ha),
        "H fit d0.01": lambda k, h, ha: weighted(k, h),
        "H fit d0.1": lambda k, h, ha: weighted(k, h, damp=0.1),
        "H fit d1": lambda k, h, ha: weighted(k, h, damp=1.0),
        "H fit d0.1 act": lambda k, h, ha: weighted(k, h, damp=0.1, order="act")}
print(f"{path.rsplit('/', 1)[1]}, {n} tokens, H from queries < {fit}, errors over queries "
      f">= {first}: relative attention-output error, score MSE")
print("layer | type | " + " | ".join(arms))
for i, (q, k, v, sc) in sorted(rec.items()):
    if only_full and types[i] != "full_attention":
        continue
    q, k, v = q[0], k[0], v[0]
    g = q.shape[0] // k.shape[0]
    sums = {a: [0.0, 0.0] for a in arms}
    for h in range(k.shape[0]):
        qg = q[h * g:(h + 1) * g]
        hf, ha = gram(qg[:, :fit]), gram(qg)
        for a, f in arms.items():
            r = attention_error(qg, k[h], f(k[h], hf, ha), v[h], sc, first)
            sums[a][0] += r[0] / k.shape[0]
            sums[a][1] += r[1] / k.shape[0]
    print(i, types[i], *(f"{e:.4f} {m:.3g}" for e, m in sums.values()), sep=" | ", flush=True)
