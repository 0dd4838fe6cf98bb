"""The decoder's opt-in fused-GEMV decode path vs its default torch path (CPU: interpreter).

`DecoderModel.set_fused_gemv(True)` routes decode-sized steps through kvtax.models.gemv
(norm + qkv, wo + residual, norm + gate/up + SiLU·up, w2 + residual, norm + lm_head); the
logits must match the torch path's within bf16 rounding, and turning it off must restore
the torch path exactly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.errors import OptionError
from kvtax.models import ModelConfig, Runner, random_model
from kvtax.models.config import get_config
from kvtax.models.decoder import gemv_blocker
from tests.support.device import DEVICE
from tests.support.tensors import assert_close

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("one_thread")]


# "tiny" at half width and two layers: the interpreter runs every program of every GEMV
SMALL = ModelConfig(
    family="llama", vocab_size=264, hidden_size=128, intermediate_size=192, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=64, rope_theta=10000.0,
    max_position_embeddings=512, bos_token_id=256, eos_token_id=(257,), name="small",
)


def _run(model, batch: int, fused: bool, steps: int = 2) -> torch.Tensor:
    """Prefill 9 tokens (torch path: 9 rows) then teacher-forced decode steps; logits
    `[B, steps + 1, V]` in float32."""
    runner = Runner(model, kv="fp16", cuda_graph=False, fused_gemv=fused)
    assert model.fused_gemv is fused
    caches = runner.make_caches(capacity=16)
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, 256, (batch, 9 + steps), generator=gen).to(DEVICE)
    out = [runner.prefill(ids[:, :9], caches)]
    for i in range(steps):
        out.append(runner.decode_step(ids[:, 9 + i : 10 + i], caches))
    return torch.stack(out, dim=1).float()


# Qwen2's layout: a bias on the fused qkv projection (the GEMV's bias epilogue)
SMALL_QWEN2 = dataclasses.replace(SMALL, family="qwen2", qkv_bias=True, name="small-qwen2")
# Gemma 3's: (1 + w) norms, sandwich norms, GELU-tanh, q/k norms, a sliding and a global layer
SMALL_GEMMA3 = dataclasses.replace(
    get_config("tiny-gemma3"), hidden_size=128, intermediate_size=192, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=64, sliding_window=8,
    layer_types=("sliding_attention", "full_attention"), name="small-gemma3")


@pytest.mark.parametrize("cfg, batch", [(SMALL, 1), (SMALL, 3), (SMALL_QWEN2, 2),
                                        (SMALL_GEMMA3, 2)],
                         ids=["llama-B1", "llama-B3", "qwen2-B2", "gemma3-B2"])
def test_fused_decode_matches_torch_path(cfg, batch):
    model = random_model(cfg, dtype=torch.bfloat16, device=DEVICE, seed=3)
    assert gemv_blocker(cfg) is None and (model.layers[0].attn.wqkv.bias is not None) == bool(
        cfg.qkv_bias)
    with torch.no_grad():  # peaked logits (tests/models/test_runner.py's _peaked): a visible signal
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.mul_(2.0)
    want = _run(model, batch, fused=False)
    got = _run(model, batch, fused=True)
    # bf16 activations: the fused path rounds once per GEMV where torch rounds after the
    # norm and the matmul too (measured here: max 0.7%, RMS 0.65% of the logit scale).
    scale = want.abs().max().item()
    assert_close(got, want, atol=0.015 * scale, rel_rms=1.2e-2, what=f"fused-B{batch}")
    assert not torch.equal(got, want)  # the fused path really ran
    assert torch.equal(_run(model, batch, fused=False), want)  # off: the torch path, bit for bit


def test_blocked_architectures_raise():
    for name in ("tiny", "tiny-gemma3"):
        assert gemv_blocker(get_config(name)) is None
    relu = dataclasses.replace(SMALL, hidden_act="relu", name="small-relu")
    assert "relu" in gemv_blocker(relu)
    model = random_model(relu, seed=0)
    with pytest.raises(OptionError, match="fused GEMV"):
        model.set_fused_gemv(True)
    model.set_fused_gemv(False)  # off is always allowed
    assert not Runner(model, kv="fp16").fused_gemv  # auto: off where it does not apply
    with pytest.raises(OptionError, match="fused GEMV"):
        Runner(model, kv="fp16", fused_gemv=True)
