"""The runner's compiled decode step (Runner(compile=...)): same logits as eager decode.

On CPU the attention is the torch reference, which dynamo splits at its data-dependent
checks; the step must still trace, run, write the token and agree. The inductor build of
the step (fused norms, RoPE, adds) is timed on the GPU (benchmarks/decode.py --compile)."""

import pytest
import torch

from kvtax.cli import main
from kvtax.errors import OptionError
from kvtax.models import load_model
from kvtax.models.runner import Runner, decode_step_fn


@pytest.mark.parametrize("kv", ["int8", "fp16"])
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
