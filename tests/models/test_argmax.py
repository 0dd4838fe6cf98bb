"""kvtax.models.argmax: the one-launch greedy argmax against torch.argmax (interpreted on
CPU; on the GPU when there is one), including ties, NaN and all -inf rows, and repeated
calls (the kernel leaves its per-row counters at zero for the next one)."""

from __future__ import annotations

import pytest
import torch

from kvtax.models import argmax as am
from kvtax.models.sampling import sample
from tests.support.device import DEVICE

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("width", [1, 7, 1024, 2049, 5000, 40000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_matches_torch(width, dtype) -> None:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(3, width, generator=gen).to(DEVICE, dtype)
    for _ in range(2):  # the second call finds the counters zeroed again
        assert torch.equal(am.argmax_rows(x), am.argmax_reference(x))


def test_argmax_ties_nan_and_infinities() -> None:
    """The first maximum across program chunks; a NaN wins (its first index); a row of
    only -inf gives 0; +inf beats every finite value; a strided view is read right."""
    w = 9000
    x = torch.zeros(6, w, device=DEVICE)
    x[0, 100] = x[0, 7000] = x[0, 4096] = 5.0            # tie across chunks: 100
    x[1, 3000] = float("nan")
    x[1, 8000] = float("nan")
    x[1, 10] = float("inf")                              # NaN still wins: 3000
    x[2] = float("-inf")                                 # all -inf: 0
    x[3, 8999] = float("inf")
    x[4, :] = -1.0
    x[4, 2047:2049] = 2.0                                # tie at a chunk edge: 2047
    x[5] = torch.arange(w, 0, -1, dtype=torch.float32)   # first column
    want = torch.tensor([[100], [3000], [0], [8999], [2047], [0]])
    assert torch.equal(am.argmax_rows(x).cpu(), want)
    assert torch.equal(am.argmax_reference(x).cpu(), want)
    wide = torch.randn(2, 2 * w, device=DEVICE)[:, ::2]  # column stride 2
    assert torch.equal(am.argmax_rows(wide), am.argmax_reference(wide))


def test_greedy_sampling_uses_it_and_bad_input_raises() -> None:
    x = torch.randn(2, 3000, device=DEVICE)
    assert torch.equal(sample(x), x.argmax(-1, keepdim=True))
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        am.argmax_rows(x[0])
    with pytest.raises(ValueError, match="float logits"):
        am.argmax_rows(x.to(torch.int32))


def test_out_and_advance_write_the_token_and_move_the_counters_on() -> None:
    """out= receives the ids; advance= raises pos by one and every row's length by one,
    once per call (what the greedy decode graph replays)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5000, generator=gen).to(DEVICE, torch.bfloat16)
    out = torch.full((3, 1), -1, dtype=torch.int64, device=DEVICE)
    pos = torch.tensor([7], device=DEVICE)
    lengths = torch.tensor([8, 8, 8], dtype=torch.int32, device=DEVICE)
    for step in range(1, 3):
        got = am.argmax_rows(x, out=out, advance=(pos, lengths))
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(out, am.argmax_reference(x))
        assert pos.item() == 7 + step
        assert lengths.tolist() == [8 + step] * 3
    plain = am.argmax_rows(x)  # without advance nothing else moves
    assert torch.equal(plain, out) and pos.item() == 9 and lengths.tolist() == [10] * 3


def test_out_and_advance_reject_wrong_buffers() -> None:
    x = torch.randn(2, 100, device=DEVICE)
    with pytest.raises(ValueError, match="out must be"):
        am.argmax_rows(x, out=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        am.argmax_rows(x, out=torch.zeros(3, dtype=torch.int64, device=DEVICE))
    pos = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="advance must be"):
        am.argmax_rows(x, advance=(pos, torch.zeros(2, dtype=torch.int64, device=DEVICE)))
    with pytest.raises(ValueError, match="advance must be"):
        am.argmax_rows(x, advance=(pos.int(), torch.zeros(2, dtype=torch.int32, device=DEVICE)))


def test_greedy_decode_step_feeds_itself() -> None:
    """decode_step_fn(greedy=True), what the greedy CUDA graph captures (here run directly
    on the torch reference attention): each call writes the logits' argmax into its own
    token buffer and moves pos / length on, so three calls in a row give the tokens of
    three logits steps with an argmax between them."""
    from kvtax.models import Runner, load_model
    from kvtax.models.decode_graph import decode_step_fn

    model = load_model("tiny", device=DEVICE, seed=3)
    runner = Runner(model, kv="int8", cuda_graph=False)
    prompt = torch.randint(0, model.config.vocab_size, (1, 20),
                           generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ref = runner.make_caches(capacity=30)
    first = am.argmax_reference(runner.prefill(prompt, ref))
    want, tok = [], first
    for _ in range(3):
        tok = am.argmax_reference(runner.decode_step(tok, ref))
        want.append(tok.item())

    caches = runner.make_caches(capacity=30)
    runner.prefill(prompt, caches)
    n = caches[0].length
    tokens = first.clone()
    pos = torch.tensor([n], device=DEVICE)
    length = torch.tensor([n + 1], dtype=torch.int32, device=DEVICE)
    step = decode_step_fn(model, caches, tokens, pos, length, greedy=True)
    got = []
    for i in range(3):
        assert step().data_ptr() == tokens.data_ptr()
        got.append(tokens.item())
        assert pos.item() == n + 1 + i and length.item() == n + 2 + i
        for c in caches:
            c.advance(1)
    assert got == want
    # on CPU the runner's greedy step is the logits step and an argmax
    assert runner.decode_greedy(tokens, caches).item() == am.argmax_reference(
        runner.decode_step(tokens, ref)).item()
