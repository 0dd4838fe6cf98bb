"""The runner's compiled decode step (Runner(compile=...)): same logits as eager decode.

On CPU the attention is the torch reference, which dynamo splits at its data-dependent
checks; the step must still trace, run, write the token and agree. The inductor build of
the step (fused norms, RoPE, adds) is timed on the GPU (benchmarks/decode.py --compile)."""

import pytest
import torch

from kvtax.cli import main
from kvtax.errors import OptionError
from kvtax.models import load_model
from kvtax.models.decode_graph import decode_step_fn
from kvtax.models.runner import Runner


@pytest.mark.parametrize("kv", ["int8", "fp16", "int8+hk+ck"])
def test_compiled_decode_step_matches_eager(kv):
    torch.manual_seed(0)
    model = load_model("tiny")
    runner = Runner(model, kv=kv)
    prompt = torch.randint(0, model.config.vocab_size, (1, 20))
    tok, tok2 = torch.tensor([[5]]), torch.tensor([[9]])

    eager_caches = runner.make_caches(capacity=40)
    runner.prefill(prompt, eager_caches)
    first = runner.decode_step(tok, eager_caches)
    second = runner.decode_step(tok2, eager_caches)

    caches = runner.make_caches(capacity=40)
    runner.prefill(prompt, caches)
    n = caches[0].length
    pos, length = torch.tensor([n]), torch.tensor([n + 1], dtype=torch.int32)
    got = decode_step_fn(model, caches, tok, pos, length, compile="aot_eager")()
    assert caches[0].length == n  # the step writes slot n; host lengths are the caller's
    torch.testing.assert_close(got, first, rtol=0, atol=1e-5)
    for c in caches:
        c.advance(1)
    # the next step sees the token the compiled step wrote
    torch.testing.assert_close(runner.decode_step(tok2, caches), second, rtol=0, atol=1e-5)


def test_compile_needs_cuda_graph_decode(capsys):
    with pytest.raises(OptionError, match="CUDA"):
        Runner(load_model("tiny"), kv="int8", compile=True)
    # the command line says so in one line, exit status 2, no traceback
    assert main(["generate", "--compile", "--max-tokens", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "kvtax generate: error:" in err and "CUDA" in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "int8+hk+ck", "int4-g32+hk+ck"])
def test_inductor_decode_step_matches_eager_on_cuda(kv):
    """The inductor build of the step (rotation matrix and key shift read as graph
    inputs/constants) vs eager decode, three steps in a row. Logits, not tokens: fused
    bf16 norms round differently, which flips near-tied greedy picks of a random model."""
    torch.manual_seed(0)
    model = load_model("tiny", dtype=torch.bfloat16, device="cuda", seed=3)
    runner = Runner(model, kv=kv, cuda_graph=False)
    prompt = torch.randint(0, model.config.vocab_size, (1, 90), device="cuda")
    toks = [torch.tensor([[t]], device="cuda") for t in (5, 9, 11)]
    eager = runner.make_caches(capacity=100)
    runner.prefill(prompt, eager)
    want = [runner.decode_step(t, eager) for t in toks]

    caches = runner.make_caches(capacity=100)
    runner.prefill(prompt, caches)
    tok = toks[0].clone()
    pos = torch.tensor([90], device="cuda")
    length = torch.tensor([91], dtype=torch.int32, device="cuda")
    step = decode_step_fn(model, caches, tok, pos, length, compile=True)
    for i, t in enumerate(toks):
        tok.copy_(t)
        got = step()
        for c in caches:
            c.advance(1)
        pos += 1
        length += 1
        scale = want[i].abs().max()
        torch.testing.assert_close(got / scale, want[i] / scale, rtol=0, atol=3e-2)
    assert caches[0].length == eager[0].length


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8+hk+ck"])
def test_compiled_graph_generate_runs(kv):
    """Runner(compile=True): the inductor step captured in a CUDA graph generates, and its
    first tokens are eager's (weights sharpened so the first picks are not near-ties)."""
    model = load_model("tiny", dtype=torch.bfloat16, device="cuda", seed=3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.mul_(2.0)
    prompt = torch.randint(0, model.config.vocab_size, (1, 90),
                           generator=torch.Generator().manual_seed(1))
    got = Runner(model, kv=kv, chunk_size=64, compile=True).generate(prompt, 24, ignore_eos=True)
    want = Runner(model, kv=kv, chunk_size=64, cuda_graph=False).generate(prompt, 24,
                                                                          ignore_eos=True)
    assert got.cuda_graph
    assert len(got.tokens) == 24 and got.tokens[:8] == want.tokens[:8]
