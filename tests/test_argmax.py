"""kvtax.models.argmax: the one-launch greedy argmax against torch.argmax (interpreted on
CPU; on the GPU when there is one), including ties, NaN and all -inf rows, and repeated
calls (the kernel leaves its per-row counters at zero for the next one)."""

from __future__ import annotations

import pytest
import torch

from tests import kernels_env as ke
from tests.kernels_env import interpret_mode  # noqa: F401 (autouse fixture)

ke.build_interpreted(("kvtax.models.kernels.argmax", "kvtax.models.argmax",
                      "kvtax.models.sampling"))

from kvtax.models import argmax as am  # noqa: E402
from kvtax.models.sampling import sample  # noqa: E402

DEVICE = ke.DEVICE


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
