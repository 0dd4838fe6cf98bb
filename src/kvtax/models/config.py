"""Decoder shapes and family switches: one dataclass, named configs, and HF config.json import.

    >>> cfg = get_config("llama-3.1-8b")
    >>> cfg.layer_windows()[:2]          # [None, None]: every Llama layer is global
    >>> ModelConfig.from_hf(json.load(open("config.json")))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
_HF_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes plus the switches that tell the decoder families apart.

    family:        llama | mistral | qwen2 | qwen3 | gemma2 | gemma3.
    layer_types:   per layer "full_attention" or "sliding_attention" (None: all full).
    rope_scaling:  HF rope_scaling dict of the global layers ("llama3", "linear") or None.
    rope_local_theta: RoPE base of sliding layers (Gemma 3), else the global base.
    The family flags (qkv_bias, qk_norm, norm_offset, sandwich_norm, embed_scale,
    hidden_act, softcaps, query_pre_attn_scalar) default from `family` when left None.
    """

    family: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_local_theta: float | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    qkv_bias: bool | None = None
    qk_norm: bool | None = None
    norm_offset: bool | None = None
    sandwich_norm: bool | None = None
    embed_scale: bool | None = None
    hidden_act: str | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; known: {', '.join(FAMILIES)}")
        gemma = self.family in ("gemma2", "gemma3")
        defaults = {
            "head_dim": self.hidden_size // self.num_heads,
            "qkv_bias": self.family == "qwen2",
            "qk_norm": self.family in ("qwen3", "gemma3"),
            "norm_offset": gemma,
            "sandwich_norm": gemma,
            "embed_scale": gemma,
            "hidden_act": "gelu_tanh" if gemma else "silu",
        }
        for key, value in defaults.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.query_pre_attn_scalar is None:
            object.__setattr__(self, "query_pre_attn_scalar", float(self.head_dim))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads do not share {self.num_kv_heads} KV heads")
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if len(types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(types)} entries for {self.num_layers} layers"
                )
            bad = set(types) - {"full_attention", "sliding_attention"}
            if bad:
                raise ValueError(f"unknown layer types {sorted(bad)}")
            if "sliding_attention" in types and not self.sliding_window:
                raise ValueError("sliding layers need sliding_window")
            object.__setattr__(self, "layer_types", types)
        object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def scale(self) -> float:
        """Attention score scale: 1/sqrt(head_dim), or Gemma's query_pre_attn_scalar**-0.5."""
        assert self.query_pre_attn_scalar is not None
        return self.query_pre_attn_scalar**-0.5

    def layer_windows(self) -> list[int | None]:
        """Per layer: None for a global layer, else its sliding window (tokens)."""
        if self.layer_types is None:
            return [self.sliding_window] * self.num_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def weight_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        d, hd = self.hidden_size, self.head_dim
        assert hd is not None
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * d * self.intermediate_size
        norms = d * (4 if self.sandwich_norm else 2) + (2 * hd if self.qk_norm else 0)
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "custom") -> "ModelConfig":
        """Translate a Hugging Face config.json (transformers 4.x or 5.x layout)."""
        if "text_config" in hf and hf.get("model_type") == "gemma3":
            hf = {**hf["text_config"], "model_type": "gemma3_text"}
        mtype = hf.get("model_type")
        if mtype not in _HF_TYPES:
            raise ValueError(
                f"model_type {mtype!r} is not supported; kvtax runs "
                f"{', '.join(sorted(_HF_TYPES))}"
            )
        family = _HF_TYPES[mtype]
        n_layers = hf["num_hidden_layers"]
        theta, scaling, local_theta = _rope_from_hf(hf, family)
        window = hf.get("sliding_window")
        layer_types = hf.get("layer_types")
        if family in ("qwen2", "qwen3"):
            if not hf.get("use_sliding_window", False):
                window, layer_types = None, None
            elif layer_types is None:  # 4.x layout: layers from max_window_layers on slide
                first = hf.get("max_window_layers", n_layers)
                layer_types = ["sliding_attention" if i >= first else "full_attention"
                               for i in range(n_layers)]
        if layer_types is None and family == "gemma2":
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                           for i in range(n_layers)]
        if layer_types is None and family == "gemma3":
            pattern = hf.get("sliding_window_pattern", 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(n_layers)]
        if layer_types is not None and "sliding_attention" not in layer_types:
            window = None
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=n_layers,
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", family.startswith("gemma")),
            sliding_window=window,
            layer_types=tuple(layer_types) if layer_types is not None else None,
            qkv_bias=True if family == "qwen2" else bool(hf.get("attention_bias", False)),
            attn_softcap=hf.get("attn_logit_softcapping"),
            final_softcap=hf.get("final_logit_softcapping"),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            name=name,
        )


def _rope_from_hf(hf: dict[str, Any], family: str) -> tuple[float, dict | None, float | None]:
    """(global theta, global scaling dict or None, local theta or None) from either layout.

    transformers 5 writes `rope_parameters` (per layer type for Gemma 3); 4.x writes
    `rope_theta`, `rope_scaling` and Gemma 3's `rope_local_base_freq`.
    """
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        glob, local = params["full_attention"], params.get("sliding_attention") or {}
    else:
        glob, local = params, {}
    legacy = hf.get("rope_scaling") or {}
    glob = {**legacy, **glob}
    # transformers 5 writes `"rope_theta": null` beside rope_parameters, so use `or`.
    theta = glob.get("rope_theta") or hf.get("rope_theta") or (1e6 if family == "gemma3" else 1e4)
    local_theta = local.get("rope_theta") or hf.get("rope_local_base_freq")
    if family == "gemma3" and local_theta is None:
        local_theta = 10000.0
    kind = glob.get("rope_type", glob.get("type", "default"))
    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in glob.items() if k not in ("rope_theta", "type")}
        scaling["rope_type"] = kind
    return float(theta), scaling, None if local_theta is None else float(local_theta)


_LLAMA31_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_NAMED: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        family="llama", vocab_size=320, hidden_size=256, intermediate_size=512, num_layers=4,
        num_heads=4, num_kv_heads=2, rope_theta=10000.0, max_position_embeddings=8192,
        bos_token_id=256, eos_token_id=(257,), name="tiny",
    ),
    "tiny-gemma3": ModelConfig(
        family="gemma3", vocab_size=320, hidden_size=256, intermediate_size=512, num_layers=6,
        num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
        rope_local_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        sliding_window=64, layer_types=("sliding_attention",) * 5 + ("full_attention",),
        bos_token_id=256, eos_token_id=(257,), name="tiny-gemma3",
    ),
    "llama-2-7b": ModelConfig(
        family="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, rope_theta=10000.0,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=(2,), name="llama-2-7b",
    ),
    "llama-3.1-8b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_id=(128001, 128008, 128009), name="llama-3.1-8b",
    ),
    "mistral-7b": ModelConfig(
        family="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=1e6,
        max_position_embeddings=32768, bos_token_id=1, eos_token_id=(2,), name="mistral-7b",
    ),
    "qwen2.5-7b": ModelConfig(
        family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=32768, eos_token_id=(151645,), name="qwen2.5-7b",
    ),
    "qwen3-8b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=40960, eos_token_id=(151645,),
        name="qwen3-8b",
    ),
    "gemma-2-2b": ModelConfig(
        family="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
        num_layers=26, num_heads=8, num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        sliding_window=4096,
        layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(26)),
        attn_softcap=50.0, final_softcap=30.0, query_pre_attn_scalar=256.0,
        bos_token_id=2, eos_token_id=(1, 107), name="gemma-2-2b",
    ),
    "gemma-3-4b": ModelConfig(
        family="gemma3", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_theta=10000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        sliding_window=1024,
        layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention"
                          for i in range(34)),
        query_pre_attn_scalar=256.0, bos_token_id=2, eos_token_id=(1, 106), name="gemma-3-4b",
    ),
}

CONFIG_NAMES: tuple[str, ...] = tuple(_NAMED)


def get_config(name: str) -> ModelConfig:
    """A built-in config by name (see CONFIG_NAMES); random weights need no download."""
    key = name.strip().lower()
    if key not in _NAMED:
        raise KeyError(f"no built-in config {name!r}; known: {', '.join(CONFIG_NAMES)}")
    return _NAMED[key]
