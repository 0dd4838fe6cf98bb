"""Build a DecoderModel: random weights from a config, or a Hugging Face checkpoint folder.

Checkpoint tensors go through an explicit name map (`hf_name_map`) that lists every tensor
the config implies, with its shape; a missing, unexpected or mis-shaped tensor raises
CheckpointError naming it. q/k/v and gate/up are concatenated into the fused projections.

    >>> model = load_model("tiny")                              # random weights, no download
    >>> model = load_model("/models/Llama-3.1-8B", dtype=torch.bfloat16, device="cuda")
    >>> model = load_model("Qwen/Qwen3-0.6B")                    # via huggingface_hub
    >>> model = load_model("SmolLM2-135M-Instruct.Q4_1.gguf")    # converted once, cached
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kvtax.errors import KVTaxError, ModelNotFoundError
from kvtax.models.config import CONFIG_NAMES, ModelConfig, get_config
from kvtax.models.decoder import DecoderModel
from kvtax.models.gguf import gguf_folder, gguf_hf_config, is_gguf

# Checkpoint prefixes of the text decoder: plain causal LMs, then Gemma 3's multimodal
# wrapper in the transformers 5 and 4 layouts.
_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")
# Tensors of a multimodal checkpoint that the text decoder does not use.
_FOREIGN = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
            "model.multi_modal_projector.")
_WEIGHT_FILES = ("*.safetensors", "*.json", "tokenizer.model")


class CheckpointError(KVTaxError, ValueError):
    """A checkpoint does not match its config: missing, unexpected or mis-shaped tensors."""


def load_model(
    source: str | os.PathLike | ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> DecoderModel:
    """A built-in config name (random weights), a ModelConfig, a local HF folder, a `.gguf`
    file (converted once to a cached folder, `kvtax.models.gguf`) or a hub id.

    Returns a DecoderModel in eval mode with `.config` and `.source` (the folder the
    weights came from, or None for random weights; the tokenizer looks there).
    """
    if isinstance(source, ModelConfig):
        return random_model(source, dtype=dtype, device=device, seed=seed)
    kind, where = locate(source)
    if kind == "builtin":
        return random_model(get_config(where), dtype=dtype, device=device, seed=seed)
    if kind == "gguf":
        return load_folder(gguf_folder(where), dtype=dtype, device=device)
    if kind == "hub":
        return load_folder(_download(where), dtype=dtype, device=device)
    return load_folder(where, dtype=dtype, device=device)


def locate(source: str | os.PathLike) -> tuple[str, str]:
    """(kind, where) of a model source, checking only that it exists: kind is "builtin"
    (where: the config name), "folder", "gguf" (where: the path) or "hub" (org/name).

    Raises ModelNotFoundError saying what a model source can be.
    """
    text = str(source)
    if text.strip().lower() in CONFIG_NAMES and not text.startswith(("./", "/")):
        return "builtin", text.strip().lower()
    path = Path(text).expanduser()
    if path.is_file() and is_gguf(path):
        return "gguf", str(path)
    if path.is_dir():
        return "folder", str(path)
    if path.exists():
        raise ModelNotFoundError(f"{text}: a model file must be a .gguf file; other "
                                 "checkpoints are folders holding config.json")
    if text.count("/") == 1 and not text.startswith((".", "/", "~")) and not is_gguf(text):
        return "hub", text
    raise ModelNotFoundError(
        f"model {text!r} not found: it is neither a built-in config ({', '.join(CONFIG_NAMES)}), "
        "a local folder, a .gguf file, nor a hub id of the form org/name"
    )


def model_config(source: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a model source without loading its weights (a GGUF file's
    metadata, a folder's config.json, a hub id's config.json); errors are KVTaxErrors."""
    kind, where = locate(source)
    if kind == "builtin":
        return get_config(where)
    if kind == "gguf":
        try:
            hf = gguf_hf_config(where)
        except Exception as exc:  # a truncated or foreign file: say which and why
            raise CheckpointError(f"{where}: cannot read its GGUF metadata "
                                  f"({type(exc).__name__}: {exc})") from None
        return _from_hf(hf, Path(where).stem)
    folder = Path(where) if kind == "folder" else _download(where, config_only=True)
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({exc})") from None
    return _from_hf(hf, folder.name)


def _from_hf(hf: dict, name: str) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf, name=name)
    except (KeyError, TypeError, ValueError) as exc:  # missing keys, an unsupported family
        raise CheckpointError(f"{name}: its config cannot be read ({type(exc).__name__}: "
                              f"{exc})") from None


def random_model(
    cfg: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> DecoderModel:
    """Random N(0, 0.02) weights (norms at identity), seeded; no allocation on the way."""
    model = _materialize(cfg, dtype, device)
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(0.0 if cfg.norm_offset else 1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.source = None
    return model


def load_folder(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> DecoderModel:
    """Load config.json + *.safetensors (single file or sharded with an index)."""
    from safetensors import safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path} has no config.json; is it a Hugging Face model folder?")
    cfg = ModelConfig.from_hf(json.loads(cfg_file.read_text()), name=path.name)
    files = _weight_files(path)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {name: h for h in handles for name in h.keys()}
    plan = hf_name_map(cfg, _prefix(where, path))
    _check_names(plan, where, cfg, path)
    model = _materialize(cfg, dtype, device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for mine, sources in plan.items():
            parts = []
            for hf_name, shape in sources:
                t = where[hf_name].get_tensor(hf_name)
                if tuple(t.shape) != shape:
                    raise CheckpointError(
                        f"{path}: tensor {hf_name} has shape {tuple(t.shape)}, expected "
                        f"{shape} from config.json ({_shape_summary(cfg)})"
                    )
                parts.append(t)
            params[mine].copy_(torch.cat(parts) if len(parts) > 1 else parts[0])
    model.source = str(path)
    return model


def hf_name_map(cfg: ModelConfig, prefix: str = "model.") -> dict[str, list[tuple[str, tuple]]]:
    """Our parameter name → the HF tensors `[(name, shape), ...]` concatenated along dim 0."""
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    assert hd is not None
    hq, hkv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    head = "language_model." if prefix == "language_model.model." else ""
    plan: dict[str, list[tuple[str, tuple]]] = {
        "embed.weight": [(f"{prefix}embed_tokens.weight", (cfg.vocab_size, d))],
        "norm.weight": [(f"{prefix}norm.weight", (d,))],
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = [(f"{head}lm_head.weight", (cfg.vocab_size, d))]
    for i in range(cfg.num_layers):
        src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
        attn = f"{src}self_attn."
        plan[dst + "attn.wqkv.weight"] = [
            (f"{attn}q_proj.weight", (hq, d)),
            (f"{attn}k_proj.weight", (hkv, d)),
            (f"{attn}v_proj.weight", (hkv, d)),
        ]
        if cfg.qkv_bias:
            plan[dst + "attn.wqkv.bias"] = [
                (f"{attn}q_proj.bias", (hq,)),
                (f"{attn}k_proj.bias", (hkv,)),
                (f"{attn}v_proj.bias", (hkv,)),
            ]
        plan[dst + "attn.wo.weight"] = [(f"{attn}o_proj.weight", (d, hq))]
        if cfg.qk_norm:
            plan[dst + "attn.q_norm.weight"] = [(f"{attn}q_norm.weight", (hd,))]
            plan[dst + "attn.k_norm.weight"] = [(f"{attn}k_norm.weight", (hd,))]
        plan[dst + "mlp.w13.weight"] = [
            (f"{src}mlp.gate_proj.weight", (inter, d)),
            (f"{src}mlp.up_proj.weight", (inter, d)),
        ]
        plan[dst + "mlp.w2.weight"] = [(f"{src}mlp.down_proj.weight", (d, inter))]
        plan[dst + "attn_norm.weight"] = [(f"{src}input_layernorm.weight", (d,))]
        if cfg.sandwich_norm:
            plan[dst + "post_attn_norm.weight"] = [(f"{src}post_attention_layernorm.weight", (d,))]
            plan[dst + "ffn_norm.weight"] = [(f"{src}pre_feedforward_layernorm.weight", (d,))]
            plan[dst + "post_ffn_norm.weight"] = [(f"{src}post_feedforward_layernorm.weight", (d,))]
        else:
            plan[dst + "ffn_norm.weight"] = [(f"{src}post_attention_layernorm.weight", (d,))]
    return plan


def _materialize(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> DecoderModel:
    """Allocate the model on `device` in `dtype` without running default initializers."""
    with torch.device("meta"):
        model = DecoderModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.reset_buffers()
    return model.eval().requires_grad_(False)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).exists()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {missing}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{path} has no *.safetensors files (PyTorch .bin checkpoints are not read; "
            "convert them with save_pretrained(safe_serialization=True))"
        )
    return files


def _prefix(where: dict, path: Path) -> str:
    for p in _PREFIXES:
        if f"{p}embed_tokens.weight" in where:
            return p
    raise CheckpointError(f"{path}: no embed_tokens.weight under any of {_PREFIXES}")


def _check_names(plan: dict, where: dict, cfg: ModelConfig, path: Path) -> None:
    wanted = {name for sources in plan.values() for name, _ in sources}
    missing = sorted(wanted - where.keys())
    if missing:
        raise CheckpointError(
            f"{path}: {len(missing)} tensor(s) the config implies are missing, e.g. "
            f"{missing[:5]} ({_shape_summary(cfg)})"
        )
    ignorable = ("rotary_emb.inv_freq",)
    extra = sorted(
        n for n in where.keys() - wanted
        if not n.startswith(_FOREIGN) and not n.endswith(ignorable)
        and not (cfg.tie_word_embeddings and n.endswith("lm_head.weight"))
    )
    if extra:
        raise CheckpointError(
            f"{path}: {len(extra)} unexpected tensor(s), e.g. {extra[:5]}; the checkpoint "
            f"does not match its config ({_shape_summary(cfg)})"
        )


def _shape_summary(cfg: ModelConfig) -> str:
    return (f"{cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads "
            f"{cfg.num_heads}/{cfg.num_kv_heads}, head_dim {cfg.head_dim}, vocab {cfg.vocab_size}")


def _download(repo_id: str, config_only: bool = False) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelNotFoundError(
            f"{repo_id!r} looks like a hub id but huggingface_hub is not installed"
        ) from exc
    patterns = ["config.json"] if config_only else list(_WEIGHT_FILES)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # offline, gated, or missing: say which id and why
        raise ModelNotFoundError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: "
            f"{exc}); pass a local folder instead"
        ) from exc
