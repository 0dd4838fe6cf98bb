"""GGUF files: read through transformers' GGUF loader, converted once to a folder kvtax reads.

transformers dequantizes the GGUF weights to float32; the converted folder (config.json,
model.safetensors, tokenizer) is cached under ~/.cache/kvtax/gguf/ (or $KVTAX_CACHE/gguf/)
by the file's path, size and mtime, so the slow parse happens once per file.

    >>> folder = gguf_folder("SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> model = load_model(folder)              # load_model("x.gguf") does this itself
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kvtax.models.tokenizer_check import check_tokenizer


def is_gguf(source: str | os.PathLike[str]) -> bool:
    """True when `source` names a .gguf file (existing or not)."""
    return Path(source).suffix.lower() == ".gguf"


def _cached_folder(gguf: Path, cache_root: str | Path | None) -> Path:
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(cache_root or os.environ.get("KVTAX_CACHE", Path.home() / ".cache" / "kvtax"))
    return root / "gguf" / f"{gguf.stem}-{key}"


def gguf_hf_config(gguf: str | os.PathLike[str]) -> dict[str, Any]:
    """The Hugging Face config dict of a `.gguf` file, read from its metadata (no tensors);
    the converted folder's config.json when the file was converted before."""
    path = Path(gguf).expanduser().resolve()
    done = _cached_folder(path, None) / "config.json"
    if done.exists():
        return json.loads(done.read_text())
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])


def gguf_folder(gguf: str | os.PathLike[str], cache_root: str | Path | None = None) -> Path:
    """A safetensors folder (config, weights, tokenizer) converted from a `.gguf` file."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf).expanduser().resolve()
    out = _cached_folder(gguf, cache_root)
    if (out / "model.safetensors").exists():
        return out
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    check_tokenizer(tok, gguf)  # before the slow part, and so a broken one is never cached
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32)
    state = {k: v.detach().contiguous().clone() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the loader takes it from the embedding
    save_file(state, str(tmp / "model.safetensors"))
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, out)
    except OSError:  # another process converted the same file first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
    return out
