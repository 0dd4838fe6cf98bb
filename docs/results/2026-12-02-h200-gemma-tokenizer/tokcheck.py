import sys, transformers
from kvtax.models.gguf import gguf_folder
from kvtax.models import load_tokenizer
from transformers import AutoTokenizer
src = sys.argv[1]
folder = gguf_folder(src, cache_root=sys.argv[2])
tok = AutoTokenizer.from_pretrained(str(folder))
s = "The quick brown fox jumps over the lazy dog. def main():\n    return 42"
ids = tok.encode(s)
print(transformers.__version__, type(tok).__name__, len(ids), ids[:24])
print([tok.decode([i]) for i in ids[:24]])
