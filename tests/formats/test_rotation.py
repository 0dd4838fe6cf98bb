"""Hadamard-rotated storage: exact in exact arithmetic, and it shrinks int4's outlier error."""

from __future__ import annotations

import pytest
import torch

from kvtax.attention import attention_blockwise
from kvtax.attention.reference import attention_naive
from kvtax.cache import FullCache, SlidingCache
from kvtax.errors import FormatError
from kvtax.formats import KVSpec, hadamard
from tests.support.tensors import assert_close, errors, rand_kv


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_hadamard_is_orthonormal_and_symmetric(d: int) -> None:
    h = hadamard(d).double()
    assert torch.allclose(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-6)
    assert torch.equal(h, h.T)
    # Every entry of a block has the same magnitude: an outlier spreads evenly.
    block = d & -d
    assert torch.allclose(h[:block, :block].abs(), torch.full((block, block), block**-0.5).double())


def test_hadamard_is_built_once_per_device() -> None:
    """Attention rotates every call's queries: the matrix must not be copied from the
    host each time (a CUDA graph cannot capture that copy, H200)."""
    assert hadamard(128, "cpu") is hadamard(128, torch.device("cpu"))


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_hadamard_built_from_indices_matches(d: int) -> None:
    """The in-graph construction (compiled regions, CUDA-graph capture) is the same
    matrix, bit for bit."""
    from kvtax.formats.rotation import _hadamard_built

    n = d & -d  # Sylvester's recursion, block-diagonal: the reference construction
    block = torch.ones(1, 1, dtype=torch.float64)
    while block.shape[0] < n:
        block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)], 0)
    sylvester = torch.block_diag(*[block / n**0.5] * (d // n)).float()
    assert torch.equal(_hadamard_built(d, torch.device("cpu"), torch.float32), sylvester)
    assert torch.equal(hadamard(d), sylvester)


def test_rotate_traces_without_host_tensors() -> None:
    """Under torch.compile, rotate builds H inside the graph when no eager call has made
    it yet (no constant copied from the host), reads the cached one as a graph constant
    when one has (nothing rebuilt per call), and gives what eager gives either way."""
    from kvtax.formats import rotate, rotation

    x = torch.randn(2, 4, 3, 96)

    def traced_ops() -> list[str]:
        seen: list[str] = []

        def backend(gm, inputs):  # records the traced ops, runs the graph as traced
            seen.extend(str(n.target) for n in gm.graph.nodes)
            return gm.forward

        torch._dynamo.reset()
        got = torch.compile(rotate, backend=backend, fullgraph=True)(x)
        torch.testing.assert_close(got, rotate(x), rtol=0, atol=1e-6)
        return seen

    rotation._MATRICES.clear()
    seen = traced_ops()
    assert any("arange" in t for t in seen), seen  # built from indices in the graph
    rotate(x)  # an eager call caches H
    seen = traced_ops()
    assert not any("arange" in t for t in seen), seen  # the cached matrix, not rebuilt


@pytest.mark.parametrize("rot", ["hk", "hkv"])
@pytest.mark.parametrize("d", [64, 96])
def test_rotation_leaves_attention_unchanged_without_quantization(rot: str, d: int) -> None:
    k, v = rand_kv((1, 2, 90, d), outliers=2), rand_kv((1, 2, 90, d))
    q = rand_kv((1, 4, 6, d))
    plain, rotated = FullCache("fp32"), FullCache(f"fp32+{rot}")
    for c in (plain, rotated):
        c.append(k, v)
    want = attention_naive(q, plain.view())
    for fn in (attention_naive, attention_blockwise):
        assert_close(fn(q, rotated.view()), want, atol=1e-5, rel_rms=1e-5, what=fn.__name__)


def test_rotated_sliding_cache() -> None:
    k, v, q = rand_kv((1, 1, 70, 64)), rand_kv((1, 1, 70, 64)), rand_kv((1, 2, 1, 64))
    plain, rotated = SlidingCache("fp32", window=16), SlidingCache("fp32+hkv", window=16)
    for c in (plain, rotated):
        c.append(k, v)
    assert_close(
        attention_blockwise(q, rotated.view()), attention_blockwise(q, plain.view()),
        atol=1e-5, rel_rms=1e-5,
    )


def test_rotation_reduces_int4_error_on_outlier_keys() -> None:
    """Keys with large outlier channels: int4+hk must beat plain int4 by a clear margin."""
    gen = torch.Generator().manual_seed(3)
    k = rand_kv((1, 2, 512, 128), outliers=4, gen=gen)
    v = rand_kv((1, 2, 512, 128), gen=gen)
    q = rand_kv((1, 8, 16, 128), gen=gen)
    ref_cache = FullCache("fp32")
    ref_cache.append(k, v)
    ref = attention_blockwise(q, ref_cache.view())
    rel = {}
    for spec in ("int4", "int4+hk"):
        c = FullCache(spec)
        c.append(k, v)
        rel[spec] = errors(attention_blockwise(q, c.view()), ref)[1]
    assert rel["int4+hk"] < 0.7 * rel["int4"], rel


def test_rotation_spec_names() -> None:
    assert KVSpec.parse("k8v4+hk").name == "k8v4+hk"
    assert KVSpec.parse("int4+hkv").rotate_values
    assert KVSpec.parse("int4+hk").bytes_per_token(128) == KVSpec.parse("int4").bytes_per_token(128)
    with pytest.raises(FormatError, match="suffixes are"):
        KVSpec.parse("int4+hq")
