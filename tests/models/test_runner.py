"""Runner behaviour on CPU: quantized-KV drift, greedy agreement, graph-safe writes, generate."""

from __future__ import annotations

import pytest
import torch

from kvtax.errors import CapacityError
from kvtax.models import Runner, load_model
from kvtax.models.sampling import _top_p_filter, sample
from tests.support.tensors import assert_close, errors

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

PROMPT = 40


def _peaked(name: str) -> torch.nn.Module:
    """A random model with weights x2 and head x5: N(0, 0.02) weights give near-flat
    logits whose argmax any rounding flips; this gives top-1 margins of ~0.3 (median)."""
    model = load_model(name, seed=3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.mul_(2.0)
        model.head_weight.mul_(2.5)
    return model


@pytest.fixture(scope="module")
def tiny():
    return _peaked("tiny")


def _prompt(batch: int = 1, n: int = PROMPT, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def _decode(model, kv: str, steps: int, forced: list | None = None, chunk: int = 32):
    """Prefill then `steps` decode steps (greedy, or teacher-forced on `forced` tokens).
    Returns (logits [B, steps + 1, V], tokens fed)."""
    runner = Runner(model, kv=kv, chunk_size=chunk)
    caches = runner.make_caches(capacity=PROMPT + steps)
    logits = [runner.prefill(_prompt(), caches)]
    fed = []
    for i in range(steps):
        tok = logits[-1].argmax(-1, keepdim=True) if forced is None else forced[i]
        fed.append(tok)
        logits.append(runner.decode_step(tok, caches))
    return torch.stack(logits, dim=1), fed


@pytest.fixture(scope="module")
def fp16_run(tiny):
    return _decode(tiny, "fp16", 256)


# kv → (per-step relative RMS bound, max abs bound) over 256 teacher-forced steps. Measured
# on this model: int8 <= 1.0e-2 / 0.05; int4 <= 0.18 / 0.85 (4-bit V dominates).
DRIFT = {"int8": (2e-2, 0.15), "int4": (0.3, 1.5)}


@pytest.mark.parametrize("kv", list(DRIFT))
def test_logit_drift_over_256_steps_is_bounded(tiny, fp16_run, kv: str) -> None:
    """Quantized-KV logits vs fp16-KV logits on the same 256 tokens: each step within the
    bound, and the error does not grow with context (last 64 steps vs first 64)."""
    ref, fed = fp16_run
    ours, _ = _decode(tiny, kv, 256, forced=fed)
    per_step = [errors(ours[:, i], ref[:, i])[1] for i in range(ours.shape[1])]
    rel_bound, abs_bound = DRIFT[kv]
    worst = max(range(len(per_step)), key=per_step.__getitem__)
    assert per_step[worst] <= rel_bound, f"{kv}: step {worst} rel RMS {per_step[worst]:.3e}"
    assert errors(ours, ref)[0] <= abs_bound
    first, last = sum(per_step[:64]) / 64, sum(per_step[-64:]) / 64
    assert last <= 1.5 * first, f"{kv}: error grows with context ({first:.2e} → {last:.2e})"


def test_int8_greedy_tokens_match_fp16(tiny, fp16_run) -> None:
    """24 free-running greedy tokens with int8 KV equal the fp16-KV ones, except past a
    step where fp16's top-2 margin is below twice int8's logit error bound (a near-tie)."""
    ref, fp16_tokens = fp16_run
    _, int8_tokens = _decode(tiny, "int8", 24)
    for i, (a, b) in enumerate(zip(int8_tokens, fp16_tokens[:24])):
        if int(a) != int(b):
            top = ref[0, i].topk(2).values
            assert top[0] - top[1] < 2 * DRIFT["int8"][1], f"tokens diverge at step {i}"
            break


def test_decode_matches_prefill_across_ring_wrap() -> None:
    """Decoding token by token and prefilling the whole sequence agree, on tiny-gemma3
    (window 64) with a 100-token prompt in chunks of 48 and 40 decode steps, so the
    sliding layers' ring wraps during prefill and again during decode."""
    model = _peaked("tiny-gemma3")
    prompt = _prompt(2, 100, seed=5)
    runner = Runner(model, kv="fp32", chunk_size=48)
    caches = runner.make_caches(capacity=140)
    logits = runner.prefill(prompt, caches)
    seq = prompt
    for step in range(40):
        tok = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, tok], dim=1)
        logits = runner.decode_step(tok, caches)
        if step in (0, 17, 39):
            whole = Runner(model, kv="fp32", chunk_size=4096)
            ref = whole.prefill(seq, whole.make_caches())
            assert_close(logits, ref, atol=1e-4, rel_rms=1e-5, what=f"decode step {step}")


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4"])
def test_graph_safe_write_path_matches_append(kv: str) -> None:
    """The CUDA-graph step's cache path (write_at at a device position + advance), run
    eagerly on CPU, gives the same logits as append; covers the sliding ring's slot map."""
    model = _peaked("tiny-gemma3")
    runner = Runner(model, kv=kv, chunk_size=32)
    a, b = runner.make_caches(capacity=170), runner.make_caches(capacity=170)
    la, lb = runner.prefill(_prompt(2, 90), a), runner.prefill(_prompt(2, 90), b)
    for _ in range(70):  # past the ring size (64 - 1 + 32 = 95 slots) from position 90
        tok = la.argmax(-1, keepdim=True)
        la = runner.decode_step(tok, a)
        n = b[0].length
        pos = torch.tensor([n])
        lens = torch.full((2,), n + 1, dtype=torch.int32)
        lb = model(tok, b, pos, write_pos=pos, length_t=lens)[:, -1].float()
        for c in b:
            c.advance(1)
        assert_close(lb, la, atol=0.0, rel_rms=0.0, what=f"{kv} write_at vs append")


def test_decode_past_capacity_raises() -> None:
    model = load_model("tiny")
    runner = Runner(model, kv="int8")
    caches = runner.make_caches(capacity=PROMPT + 1)
    logits = runner.prefill(_prompt(), caches)
    logits = runner.decode_step(logits.argmax(-1, keepdim=True), caches)
    with pytest.raises(CapacityError):
        runner.decode_step(logits.argmax(-1, keepdim=True), caches)


def test_generate_stops_on_eos_streams_and_ignores_eos(tiny) -> None:
    runner = Runner(tiny, kv="int8")
    free = runner.generate(_prompt(), 12, ignore_eos=True)
    assert len(free.tokens) == 12 and free.prompt_tokens == PROMPT
    assert free.cache_bytes > 0 and free.decode_tokens_per_s > 0 and free.ttft_s > 0
    streamed: list[int] = []
    eos = free.tokens[4]
    stop = runner.generate(_prompt(), 12, eos_token_id=eos, on_token=streamed.append)
    assert stop.tokens == free.tokens[: free.tokens.index(eos) + 1] == streamed
    assert stop.stopped_on_eos


def test_sampling_is_seeded_and_top_p_restricts(tiny) -> None:
    runner = Runner(tiny, kv="fp16")
    hot = dict(temperature=1.5, ignore_eos=True)
    a = runner.generate(_prompt(), 16, seed=1, **hot).tokens
    assert a == runner.generate(_prompt(), 16, seed=1, **hot).tokens
    assert a != runner.generate(_prompt(), 16, seed=2, **hot).tokens
    greedy = runner.generate(_prompt(), 16, ignore_eos=True).tokens
    # top_p below any second token's share keeps only the argmax: sampling = greedy.
    assert runner.generate(_prompt(), 16, top_p=1e-6, seed=4, **hot).tokens == greedy


def test_top_p_filter_keeps_the_nucleus() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.3, 0.15]])
    kept = _top_p_filter(probs, 0.7)  # 0.5 then 0.3 reach 0.7; 0.15 and 0.05 go
    assert torch.equal(kept > 0, torch.tensor([[False, True, True, False]]))
    draws = torch.cat([sample(torch.log(probs), temperature=1.0, top_p=0.7,
                              generator=torch.Generator().manual_seed(i)) for i in range(400)])
    share = (draws == 1).float().mean().item()  # 0.5 / 0.8 = 0.625 of the nucleus
    assert set(draws.view(-1).tolist()) == {1, 2} and abs(share - 0.625) < 0.08


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3"])
@pytest.mark.parametrize("kv", ["fp16", "int8", "int4", "k8v4", "int8+hk+ck"])
def test_cuda_graph_and_eager_give_the_same_tokens(name: str, kv: str) -> None:
    model = load_model(name, dtype=torch.bfloat16, device="cuda", seed=3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.mul_(2.0)
    prompt = _prompt(1, 150)  # tiny-gemma3: longer than the window, so the ring wraps
    graph = Runner(model, kv=kv, chunk_size=64)
    eager = Runner(model, kv=kv, chunk_size=64, cuda_graph=False)
    got = graph.generate(prompt, 80, ignore_eos=True)
    want = eager.generate(prompt, 80, ignore_eos=True)
    assert got.cuda_graph, graph.graph_disabled_reason
    assert got.tokens == want.tokens


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_greedy_graph_feeds_itself_and_mixes_with_logits_steps(kv: str) -> None:
    """decode_greedy's graph (the argmax and the counters inside it) gives eager greedy
    decoding's tokens whether its own buffer is fed back or a fresh tensor, and stays in
    step when decode_step calls advance the same caches in between."""
    model = load_model("tiny", dtype=torch.bfloat16, device="cuda", seed=3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.mul_(2.0)
    prompt = _prompt(1, 60).cuda()
    eager = Runner(model, kv=kv, chunk_size=32, cuda_graph=False)
    ref = eager.make_caches(capacity=100)
    tok = sample(eager.prefill(prompt, ref))
    want = []
    for _ in range(30):
        tok = sample(eager.decode_step(tok, ref))
        want.append(tok.item())

    runner = Runner(model, kv=kv, chunk_size=32)
    caches = runner.make_caches(capacity=100)
    tok = sample(runner.prefill(prompt, caches))
    got = []
    for i in range(30):
        if i in (10, 11):  # the logits graph moves the caches on in between
            tok = sample(runner.decode_step(tok, caches))
        elif i == 20:  # a fresh tensor (not the graph's buffer) with the same ids
            tok = runner.decode_greedy(tok.clone(), caches)
        else:
            tok = runner.decode_greedy(tok, caches)
        got.append(tok.item())
    assert runner.graph_captured(greedy=True) and runner.graph_captured(greedy=False)
    assert got == want
