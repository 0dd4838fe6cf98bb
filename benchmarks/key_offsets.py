"""Per-layer key statistics of a model's first prefill chunk: how much of the keys is one
constant vector (what `+ck` removes), and each format's key reconstruction error.

    python benchmarks/key_offsets.py --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --context 2048

Prints, per layer: `offset` = ||mean over tokens|| · sqrt(T) / ||K|| (the share of the keys'
Frobenius norm that the per-channel mean carries; 1.0 = every key is the same vector) and,
for each format, ||dequant(quant(K')) - K'|| / ||K'|| where K' is what the cache stores
(centered and/or rotated). The text is the same prose `kvtax quality` reads by default.
"""

from __future__ import annotations

import argparse

import torch

from kvtax.cache import FullCache
from kvtax.formats import KVSpec, rotate
from kvtax.harness.quality.probe import text_ids, text_of
from kvtax.harness.recall.models import load_recall_model
from kvtax.models.runner import Runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="built-in config, HF folder or .gguf")
    p.add_argument("--context", type=int, default=2048, help="tokens in the (single) chunk")
    p.add_argument("--kv", default="int8+hk,int8+hk+ck,int4-g32+hk,int4-g32+hk+ck",
                   help="comma-separated specs whose key error to report")
    args = p.parse_args()
    specs = [KVSpec.parse(s) for s in args.kv.split(",")]
    loaded = load_recall_model(args.model, engine="kvtax", dtype="float32", device="cpu",
                               chunk_size=args.context, seed=0)
    net = loaded.model
    ids = torch.tensor([text_ids(loaded.tokenizer, text_of(None), args.context)])
    caches = [FullCache("fp32") for _ in range(net.config.num_layers)]
    with torch.no_grad():
        Runner(net, kv="fp32", chunk_size=args.context).prefill(ids, caches)
    print("layer  offset  " + "  ".join(f"{s.name:>16}" for s in specs))
    for i, c in enumerate(caches):
        k = c.view().k.codes[:, :, : args.context].float()  # [B, H_kv, T, D], post-RoPE
        mean = k.mean(2, keepdim=True)
        offset = float(mean.norm() * k.shape[2] ** 0.5 / k.norm())
        errs = []
        for s in specs:
            x = k - mean if s.center_keys else k
            x = rotate(x) if s.rotate_keys else x
            errs.append(float((s.key.dequantize(s.key.quantize(x)) - x).norm() / x.norm()))
        print(f"{i:5d}  {offset:6.2f}  " + "  ".join(f"{e:16.4f}" for e in errs))


if __name__ == "__main__":
    main()
