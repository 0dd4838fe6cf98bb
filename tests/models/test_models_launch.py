"""kvtax.models.launch: an experiment's decode launch overrides, handed to the Runner, reach
exactly the launches they name (CPU: the GEMVs interpreted, the attention configs built)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.cache import FullCache
from tests.support.device import DEVICE

from kvtax.attention import triton_api as ta  # noqa: E402
from kvtax.errors import OptionError  # noqa: E402
from kvtax.models import ModelConfig, Runner, random_model  # noqa: E402
from kvtax.models import gemv as gm  # noqa: E402
from kvtax.models.launch import DecodeLaunch  # noqa: E402

SMALL = ModelConfig(
    family="llama", vocab_size=264, hidden_size=128, intermediate_size=192, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=64, rope_theta=10000.0,
    max_position_embeddings=512, bos_token_id=256, eos_token_id=(257,), name="small",
)

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("one_thread")]


def test_parse_reads_scopes_and_refuses_bad_items():
    launch = DecodeLaunch.parse(" gemv.block_k=64, o.block_n=2,o.split_k=2 ,attn.per_sm=6")
    assert launch.gemv == {"gemv": {"block_k": 64}, "o": {"block_n": 2, "split_k": 2}}
    assert launch.attention == {"per_sm": 6}
    assert DecodeLaunch.parse("").is_default and not launch.is_default
    for bad in ("o.block_n", "mlp.block_n=2", "o.block_n=x", "o.bogus=1", "attn.bogus=1"):
        with pytest.raises(OptionError):
            DecodeLaunch.parse(bad)


def test_gemv_config_replaces_fields_of_the_default_for_the_named_projection():
    launch = DecodeLaunch.parse("gemv.block_k=64,o.block_k=128,o.block_n=2")
    x, w = torch.zeros(1, 4096), torch.zeros(4096, 4096, dtype=torch.float32)
    base = gm.default_config_for(x, w)
    assert launch.gemv_config("o", x, w) == dataclasses.replace(base, block_k=128, block_n=2)
    assert launch.gemv_config("down", x, w) == dataclasses.replace(base, block_k=64)
    assert DecodeLaunch.parse("o.block_n=2").gemv_config("qkv", x, w) is None


def test_runner_hands_the_overrides_to_each_projection(monkeypatch):
    """Each fused GEMV of a decode step gets its projection's config (None: the default);
    the logits stay those of the default launch, and the next Runner without `launch`
    puts the defaults back."""
    torch.manual_seed(0)
    model = random_model(SMALL, dtype=torch.float32, device=DEVICE)
    seen: list = []
    real = gm.gemv

    def spy(x, w, **kw):  # noqa: ANN001, ANN202
        seen.append(kw.get("config"))
        return real(x, w, **kw)

    monkeypatch.setattr(gm, "gemv", spy)
    ids = torch.tensor([[1, 2, 3]], device=DEVICE)

    def step(launch):  # noqa: ANN001, ANN202
        runner = Runner(model, kv="fp16", cuda_graph=False, fused_gemv=True, launch=launch)
        caches = runner.make_caches(capacity=8)
        runner.prefill(ids, caches)
        seen.clear()  # the decode step's launches only
        return runner.decode_step(ids[:, -1:], caches), list(seen)

    want, default_cfgs = step(None)
    assert default_cfgs == [None] * 5  # qkv, o, gate_up, down, lm_head
    got, cfgs = step(DecodeLaunch.parse("o.block_n=2,o.block_k=32,lm_head.split_k=2"))
    assert [c is not None for c in cfgs] == [False, True, False, False, True]
    assert (cfgs[1].block_n, cfgs[1].block_k, cfgs[4].split_k) == (2, 32, 2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    step(None)
    assert seen == [None] * 5 and model.launch.is_default


def test_attention_config_forces_the_decode_keywords():
    cache = FullCache("int8", capacity=4096)
    k = torch.randn(1, 2, 300, 128, dtype=torch.bfloat16)
    cache.append(k, k)
    q = torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)
    view = cache.view()
    base = ta.launch_config(q, view)
    make = {"swap": ta.swap_decode_config, "warp": ta.warp_decode_config}[base.kernel]
    forced = DecodeLaunch.parse("attn.per_sm=1").attention_config(q, view)
    assert forced == make(q, view, None, per_sm=1)
    assert forced.kernel == base.kernel and forced.num_splits < base.num_splits
    assert DecodeLaunch().attention_config(q, view) is None


def test_model_attends_through_the_forced_launch(monkeypatch):
    """With attention overrides each layer's attention goes through DecodeLaunch.attend
    (the ordinary dispatch where the kernels cannot serve, as on this CPU); a Runner
    without them puts the plain dispatch back; they cannot be compiled."""
    model = random_model(SMALL, dtype=torch.float32, device=DEVICE)
    calls = []
    real = DecodeLaunch.attend

    def spy(self, q, view, **kw):  # noqa: ANN001, ANN202
        calls.append(q.shape)
        return real(self, q, view, **kw)

    monkeypatch.setattr(DecodeLaunch, "attend", spy)
    ids = torch.tensor([[1, 2, 3]], device=DEVICE)
    runner = Runner(model, kv="int8", cuda_graph=False, fused_gemv=False,
                    launch=DecodeLaunch.parse("attn.per_sm=2"))
    caches = runner.make_caches(capacity=8)
    want = runner.prefill(ids, caches)
    assert len(calls) == SMALL.num_layers
    plain = Runner(model, kv="int8", cuda_graph=False, fused_gemv=False)
    assert torch.equal(plain.prefill(ids, plain.make_caches(capacity=8)), want)
    assert len(calls) == SMALL.num_layers  # the defaults again: no forced launch
    with pytest.raises(OptionError, match="cannot be compiled"):
        Runner(model, kv="int8", cuda_graph=False, compile=True,
               launch=DecodeLaunch.parse("attn.per_sm=2"))
