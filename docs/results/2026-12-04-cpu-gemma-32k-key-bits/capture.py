"""Post-RoPE queries, keys and values of every layer (and its score scaling) from one float32
forward of a GGUF model over the first N tokens of the usual text (CPython's
pydoc_data/topics.py), through transformers with an attention function that records them."""
import pydoc_data.topics as topics
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

REC = {}

def capture(module, q, k, v, mask, **kw):
    REC[module.layer_idx] = (q.detach().clone(), k.detach().clone(), v.detach().clone(), kw.get("scaling"))
    return sdpa_attention_forward(module, q, k, v, mask, **kw)

AttentionInterface.register("capture", capture)

def run(path: str, n: int):
    """(model, layer types, {layer: (q `[1, Hq, N, D]`, k, v `[1, Hkv, N, D]`, scaling)})."""
    torch.set_num_threads(1)
    folder, name = path.rsplit("/", 1)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="capture").eval()
    ids = tok(open(topics.__file__).read(), return_tensors="pt").input_ids[:, :n]
    with torch.no_grad():
        model(ids, use_cache=False)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * len(REC)
    return model, types, REC
