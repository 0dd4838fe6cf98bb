"""Gemma-3 fp16-KV perplexity: kernels vs reference attention, per-layer kernel error."""
import hashlib, sys, time, torch
from kvtax.harness.recall.models import load_recall_model
from kvtax.harness.quality.probe import text_ids, text_of, score_pass
from kvtax.cache import make_caches
from kvtax.attention import attention as att
import kvtax.models.decoder as dec

src, dev = sys.argv[1], sys.argv[2]
ctxs = [int(x) for x in sys.argv[3].split(",")]
impls = sys.argv[4].split(",") if len(sys.argv) > 4 else ["auto", "reference"]
text = sys.argv[5] if len(sys.argv) > 5 else None
t = time.time()
rm = load_recall_model(src, engine="kvtax", dtype="float32", device=dev, chunk_size=2048)
net = rm.model
print("loaded", round(time.time() - t, 1), "s; windows", net.config.layer_windows()[:6], flush=True)
errs = {}
def hook(i, impl):
    def fn(q, v, **kw):
        o = att(q, v, impl=impl, **kw)
        if impl == "auto" and dev == "cuda":
            r = att(q, v, impl="reference", **kw)
            e = float((o.float() - r.float()).norm() / r.float().norm())
            errs[i] = max(errs.get(i, 0.0), e)
        return o
    return fn
for ctx in ctxs:
    all_ids = text_ids(rm.tokenizer, text_of(text), ctx + 1)
    ids = torch.tensor([all_ids])
    print("ctx", ctx, "ids sha", hashlib.sha256(str(all_ids).encode()).hexdigest()[:12], flush=True)
    for chunk in (2048, 256):
        for impl in impls:
            errs.clear()
            layers = [m for m in net.modules() if isinstance(m, dec.Attention)]
            for i, m in enumerate(layers):
                m.attn_fn = hook(i, impl)
            caches = make_caches(net.config.layer_windows(), "fp16", max_chunk=chunk)
            t = time.time()
            stats, _ = score_pass(net, caches, ids, chunk=chunk, tail=128)
            s = stats.summary()
            print(f"ctx {ctx} chunk {chunk} impl {impl}: ppl {s['ppl']:.4g} ppl_full {s['ppl_full']:.4g} [{time.time()-t:.1f} s]", flush=True)
            if errs:
                print("  layer rel err (kernel vs reference):", {k: f"{v:.1e}" for k, v in sorted(errs.items())}, flush=True)
