"""The q4 short name through the Runner: chunked prefill and decode give the logits of one
whole prefill (q4's body reads only complete 64-token blocks), on full and sliding layers;
the CUDA-graph decode step (write_at at a device position) equals eager decode, and the
runner captures it where the kernels serve the caches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention.baselines import ATTENTION_PATHS
from kvtax.harness.bench.hooks import use_attention
from kvtax.models import Runner, load_model
from kvtax.models.config import get_config
from kvtax.models.decode_graph import cache_key, decode_step_fn, graph_blocker
from kvtax.models.sampling import sample
from tests.support.tensors import assert_close


@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3"])
def test_q4_logits_do_not_depend_on_chunking(name) -> None:
    cfg = get_config(name)
    if cfg.sliding_window:  # a window past the 128 recent tokens: a c64 sliding body
        cfg = dataclasses.replace(cfg, sliding_window=300)
    model = load_model(cfg)
    ids = torch.randint(0, 256, (1, 420), generator=torch.Generator().manual_seed(0))
    logits = []
    for chunk in (420, 7, 130):
        # q4's sliding layers keep their recent tokens in int8 (k4-c64v4-g128@r64i8,
        # SLIDING_FORMS); named here, they keep fp16 ones around the same c64 ring body
        runner = Runner(model, kv="q4", sliding_kv="k4w-c64v4@s4r128", chunk_size=chunk)
        caches = runner.make_caches()
        assert {c.spec.name for c in caches} == {"k4w-c64v4@s4r128"}
        out = [runner.prefill(ids[:, :400], caches)]
        out += [runner.decode_step(ids[:, t:t + 1], caches) for t in range(400, 420)]
        logits.append(torch.stack(out))
    assert torch.isfinite(logits[0]).all()
    for other in logits[1:]:
        # loose: the fp16 recent window's LSE merge alone moves these logits by ~2e-4 (as
        # with int4@s4r128); keys read from a stale or open block move them by ~7e-3
        assert_close(other, logits[0], atol=1e-3, rel_rms=1e-3, what="chunked prefill")
    fp16 = Runner(model, kv="fp16", chunk_size=420)
    caches = fp16.make_caches()
    ref = fp16.prefill(ids[:, :400], caches)
    gap = (logits[0][0] - ref).abs().max()
    assert 0 < gap < 1.0, "q4 differs from fp16 KV, a little"


def _peaked(source, **kw) -> torch.nn.Module:
    """A random model with weights x2 (top-1 margins an argmax survives rounding with,
    as tests/models/test_runner.py's)."""
    model = load_model(source, seed=3, **kw)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.mul_(2.0)
    return model


def _config(name: str):
    """`name`'s config, a sliding window past q4's 128 recent tokens: q4's sliding layers
    then hold k4-c64v4-g128@r64i8 (SLIDING_FORMS): a c64 ring body and an int8 recent ring."""
    cfg = get_config(name)
    return dataclasses.replace(cfg, sliding_window=300) if cfg.sliding_window else cfg


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kv", ["q4", "k4-c64v4+hk+ck@s4r128"])
@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3"])
def test_q4_captured_step_equals_eager_decode(name, kv) -> None:
    """The step a CUDA graph captures (`decode_step_fn`: K/V written at a device position,
    lengths from device tensors, the host counts advanced after), run eagerly on CPU, gives
    eager decode's logits exactly, through blocks that end and start and the fp16 ring's
    wrap; batch 2."""
    model = load_model(_config(name), seed=3)
    runner = Runner(model, kv=kv, chunk_size=64)
    prompt = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(1))
    eager, graph = runner.make_caches(capacity=230), runner.make_caches(capacity=230)
    la, lb = runner.prefill(prompt, eager), runner.prefill(prompt, graph)
    tokens = torch.zeros(2, 1, dtype=torch.long)
    pos = torch.full((1,), 150, dtype=torch.long)
    length = torch.full((2,), 151, dtype=torch.int32)
    step = decode_step_fn(model, graph, tokens, pos, length)
    for i in range(80):
        tok = la.argmax(-1, keepdim=True)
        la = runner.decode_step(tok, eager)
        tokens.copy_(tok)
        lb = step()
        for c in graph:
            c.advance(1)
        pos += 1
        length += 1
        assert torch.equal(lb, la), f"{name} {kv}: step {i}"


def _prefilled(name: str, kv: str, capacity: int | None = 200):
    model = load_model(_config(name), seed=3)
    runner = Runner(model, kv=kv, chunk_size=64)
    caches = runner.make_caches(capacity=capacity)
    runner.prefill(torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(2)),
                   caches)
    return model, caches


@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3"])
def test_graph_blocker_lets_q4_through_where_the_kernels_serve(name, monkeypatch) -> None:
    """Presized q4 and q3 caches (full layers, and a c64 sliding body) pass once the
    kernels serve CPU tensors (the interpreter standing in for CUDA); else one clear
    reason each."""
    from kvtax.attention import triton_api

    model, caches = _prefilled(name, "q4")
    assert "not on a CUDA device" in graph_blocker(model, caches)
    serve = triton_api.unsupported_reason
    monkeypatch.setattr(triton_api, "unsupported_reason",
                        lambda q, view: serve(q, view, allow_cpu=True))
    assert graph_blocker(model, caches) is None
    assert cache_key(caches) == cache_key(caches) != cache_key(_prefilled(name, "q4")[1])
    _, growable = _prefilled(name, "q4", capacity=None)
    assert "may grow" in graph_blocker(model, growable)
    empty = Runner(model, kv="q4").make_caches(capacity=200)
    assert "empty" in graph_blocker(model, empty)
    for kv in ("q3", "k3-c64v4@s4r128"):  # 3-bit codes: the tile kernels read them too
        assert graph_blocker(model, _prefilled(name, kv)[1]) is None, kv
    with use_attention(model, ATTENTION_PATHS["dequant"]):
        assert "does not read hybrid caches" in graph_blocker(model, caches)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3"])
@pytest.mark.parametrize("kv", ["q4", "k4-c64v4+hk+ck@s4r128"])
def test_q4_cuda_graph_and_eager_decode_agree(name, kv) -> None:
    """Runner(kv="q4") captures its decode step (logits and greedy graphs) and, fed the same
    tokens as eager decoding, gives its logits within bf16 rounding, across block
    boundaries, the fp16 ring's wrap and a recall-style trim; its greedy token is eager's
    wherever eager's top-1 leads by more than rounding. (Exact token equality over 80
    free-running steps is not asked: graph and eager split the work differently, by
    capacity and by length, and one near-tie flipped a token at step 77 on an H200.)"""
    model = _peaked(_config(name), dtype=torch.bfloat16, device="cuda")
    prompt = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(0)).cuda()
    graph = Runner(model, kv=kv, chunk_size=64)
    eager = Runner(model, kv=kv, chunk_size=64, cuda_graph=False)
    gc, ec = graph.make_caches(capacity=300), eager.make_caches(capacity=300)
    graph.prefill(prompt, gc)
    le = eager.prefill(prompt, ec)
    for i in range(100):
        if i == 60:  # drop 30 tokens, then a follow-up prompt, as kvtax recall does
            for c in (*gc, *ec):
                c.trim(30)
            graph.prefill(prompt[:, :20], gc)
            le = eager.prefill(prompt[:, :20], ec)
        tok = sample(le)
        if i % 7:
            lg, le = graph.decode_step(tok, gc), eager.decode_step(tok, ec)
            assert_close(lg.float(), le.float(), atol=0.25, rel_rms=2e-2, what=f"step {i}")
        else:
            got, le = graph.decode_greedy(tok, gc), eager.decode_step(tok, ec)
            top2 = le.float().topk(2, dim=-1).values
            if (top2[..., 0] - top2[..., 1]).min() > 0.1:
                assert got.view(-1).tolist() == le.argmax(-1).view(-1).tolist(), f"step {i}"
    assert graph.graph_captured(greedy=True) and graph.graph_captured(greedy=False)
