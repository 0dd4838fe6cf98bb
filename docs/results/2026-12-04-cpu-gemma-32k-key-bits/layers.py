"""Per-layer relative attention error of the global layers (5, 11, 17) and the sliding
layers' mean, with KL, from run folders' rows.jsonl. python layers.py FOLDER [FOLDER ...]"""
import glob
import json
import sys

for folder in sys.argv[1:]:
    for f in sorted(glob.glob(folder + "/**/rows.jsonl", recursive=True)):
        for line in open(f):
            r = json.loads(line)
            e = r.get("layer_attn_rel_err")
            if r.get("kind") != "quality" or not e:
                continue
            slide = [e[i] for i in range(len(e)) if i not in (5, 11, 17)]
            print(folder.rstrip("/").rsplit("/", 1)[-1], f"chunk {r['chunk_size']}", f"KL {r['kl']:.3g}",
                  "global " + " ".join(f"{e[i]:.4f}" for i in (5, 11, 17)),
                  f"sliding mean {sum(slide) / len(slide):.4f}", sep=" | ")
