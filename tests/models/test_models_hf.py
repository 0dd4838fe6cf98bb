"""The lean decoder against transformers' own implementation of each family.

Each case builds a tiny random HF model (2 layers), randomizes every weight (norms and
biases too), saves it with `save_pretrained`, loads the folder through kvtax's loader and
runs the runner: a chunked prefill then 32 greedy decode steps. The same token sequence
goes through the HF model in one forward; logits must agree at every step.
"""

from __future__ import annotations

import pytest
import torch

from kvtax.models import Runner, load_model
from tests.support.tensors import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

transformers = pytest.importorskip("transformers")

PROMPT, STEPS = 24, 32

COMMON = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    initializer_range=0.08,
)


def _llama():
    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}  # small, so scaling bites at 56 tokens
    cfg = transformers.LlamaConfig(**COMMON, rope_parameters=scaling)
    return transformers.LlamaForCausalLM(cfg)


def _mistral():  # sliding window 12 < prompt 24 on every layer
    return transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=12))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON))


def _gemma2():  # layer 0 slides (window 8), layer 1 global; both soft-caps on
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **COMMON, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0))


def _gemma3():  # sliding layer with the local RoPE base, global layer with linear scaling
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **COMMON, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters=rope, query_pre_attn_scalar=24))


BUILDERS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3,
            "gemma2": _gemma2, "gemma3": _gemma3}


def _hf_model(family: str, folder) -> torch.nn.Module:
    torch.manual_seed(hash(family) % 1000)
    model = BUILDERS[family]()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF inits norms at identity, which would hide a wrong formula
                base = 0.0 if family.startswith("gemma") else 1.0
                p.copy_(base + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.eval()
    model.save_pretrained(folder)
    return model


def _run(runner: Runner, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill + STEPS greedy steps; returns (logits [B, STEPS + 1, V], all tokens [B, T])."""
    caches = runner.make_caches(capacity=prompt.shape[1] + STEPS)
    logits = [runner.prefill(prompt, caches)]
    tokens = prompt
    for _ in range(STEPS):
        nxt = logits[-1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
        logits.append(runner.decode_step(nxt, caches))
    return torch.stack(logits, dim=1), tokens


# (kv format, max abs, rel RMS): fp32 KV is exact storage, so only op-order noise remains;
# fp16 KV rounds K/V to 11-bit mantissas (~5e-4 relative), which logits inherit.
KV_TOL = {"fp32": (2e-5, 5e-6), "fp16": (5e-3, 1e-3)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family → (HF model, folder it was saved to); each family built once per module."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            cache[family] = (_hf_model(family, folder), folder)
        return cache[family]

    return get


@pytest.mark.parametrize("kv", list(KV_TOL))
@pytest.mark.parametrize("family", list(BUILDERS))
def test_logits_match_transformers(family: str, kv: str, built) -> None:
    hf, folder = built(family)
    model = load_model(folder, dtype=torch.float32)
    assert model.config.family == family
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, COMMON["vocab_size"], (2, PROMPT), generator=gen)
    # chunk 8 < prompt 24: three chunks, and for sliding layers chunk == window.
    ours, tokens = _run(Runner(model, kv=kv, chunk_size=8), prompt)
    with torch.no_grad():
        ref = hf(tokens).logits[:, PROMPT - 1 :].float()
    atol, rel = KV_TOL[kv]
    assert_close(ours, ref, atol=atol, rel_rms=rel, what=f"{family} {kv}-KV logits")


def test_unchunked_prefill_matches_chunked(built) -> None:
    """One 24-token chunk and chunks of 5 (not dividing 24) give the same logits."""
    model = load_model(built("gemma3")[1], dtype=torch.float32)
    prompt = torch.randint(0, COMMON["vocab_size"], (1, PROMPT), generator=torch.Generator())
    whole, _ = _run(Runner(model, kv="fp32", chunk_size=2048), prompt)
    chunked, _ = _run(Runner(model, kv="fp32", chunk_size=5), prompt)
    assert_close(chunked, whole, atol=1e-4, rel_rms=1e-5, what="chunked vs whole prefill")
