"""One line per measured arm of the run folders given: context, chunk, KL ± s.e., median /
max, top-1, Δppl (fp16 ppl), the global layers' (5, 11, 17) relative attention errors and
the other layers' mean. python table.py FOLDER [FOLDER ...]"""
import glob
import json
import sys

GLOBAL = (5, 11, 17)
for folder in sys.argv[1:]:
    for f in sorted(glob.glob(folder + "/**/rows.jsonl", recursive=True)):
        for line in open(f):
            r = json.loads(line)
            e = r.get("layer_attn_rel_err")
            if r.get("kind") != "quality" or not e:
                continue
            full = [i for i in GLOBAL if i < len(e)] if len(e) == 18 else []
            rest = [e[i] for i in range(len(e)) if i not in full]
            print(folder.rstrip("/"), r["context"], f"chunk {r['chunk_size']}", r["kv"],
                  f"KL {r['kl']:.3g} ± {r['kl_sem']:.2g}",
                  f"median {r['kl_median']:.2g} max {r['kl_max']:.3g}", f"top-1 {r['top1']:.3f}",
                  f"Δppl {r['ppl_delta']:+.3f} ({r['ppl_base']:.2f})",
                  "global " + " ".join(f"{e[i]:.4f}" for i in full) if full else "",
                  f"{'other' if full else 'all'} layers mean {sum(rest) / len(rest):.4f}",
                  f"max {max(rest):.4f}", sep=" | ")
