"""Fused kernels for hybrid caches: per-row log-sum-exp and the min_distance / min_key masks
against the torch reference `attention_lse`, and hybrid attention end to end.

Small shapes through Triton's interpreter on CPU (tests/conftest.py), compiled on a
GPU. Launch configs with 16-slot tiles make short caches cover every loop of the kernels:
a masked head tile (keys before min_key), unmasked middle tiles, a masked tail.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from kvtax.attention import dispatch as dispatch_mod
from kvtax.attention import launch, triton_api
from kvtax.attention.dispatch import attention as hybrid_attention, part_attention
from kvtax.attention.lse import attention_lse
from kvtax.attention.triton_api import LaunchConfig, triton_attention_lse
from kvtax.cache.hybrid import HybridCache
from kvtax.errors import ShapeError
from tests.support import kernels as ke
from tests.support.kernels import DEVICE, TOLERANCE, build

pytestmark = pytest.mark.kernels

# (atol, rel RMS) of the log-sum-exp, by query dtype (scores of O(1..10))
LSE_TOLERANCE = {torch.float16: (1e-2, 2e-3), torch.bfloat16: (6e-2, 1e-2),
                 torch.float32: (2e-3, 5e-4)}


@pytest.fixture(autouse=True)
def _poison_workspace(monkeypatch):
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)  # out, lse start as NaN


def _config(kind: str, q: torch.Tensor, view) -> LaunchConfig | None:
    """auto: the launch table; warp16 / tile16 / prefill16: that kernel with 16-slot tiles."""
    rows = q.shape[1] // view.num_kv_heads * q.shape[2]
    if kind == "warp16":
        return triton_api.warp_decode_config(q, view, block_n=16)
    if kind == "tile16":
        return LaunchConfig("decode", max(16, 1 << (rows - 1).bit_length()), 16, 4, 2, 3,
                            fold=True)
    if kind == "prefill16":
        return LaunchConfig("prefill", 16, 16, 4, 2)
    return None


def check_lse(q, view, *, min_distance=0, min_key=0, kind="auto", what="", **kw):
    """Kernels vs `attention_lse` on out and lse; rows that see no key: out 0, lse -inf."""
    cfg = _config(kind, q, view)
    out, lse = triton_attention_lse(q, view, min_distance=min_distance, min_key=min_key,
                                    config=cfg, **kw)
    ref_out, ref_lse = attention_lse(q.float(), view, min_distance=min_distance,
                                     min_key=min_key, **kw)
    assert out.dtype == lse.dtype == torch.float32
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{what}: rows with / without keys differ"
    assert not torch.isnan(lse).any(), f"{what}: lse holds NaN (unwritten row?)"
    assert bool((lse[~seen] == float("-inf")).all()), f"{what}: an empty row's lse is not -inf"
    atol, rel = TOLERANCE[q.dtype]
    ke.assert_close(out, ref_out, atol=atol, rel_rms=rel, what=f"{what} out")
    atol, rel = LSE_TOLERANCE[q.dtype]
    ke.assert_close(lse[seen], ref_lse[seen], atol=atol, rel_rms=rel, what=f"{what} lse")
    return out, lse, seen


F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# (spec, head_dim, h_kv, group, ctx, n_q, dtype, min_distance, min_key, launch)
CASES = [
    ("int4-g32+hk", 64, 1, 4, 150, 1, F16, 17, 4, "warp16"),  # the default body, decode
    ("int4-g32+hk", 64, 1, 4, 150, 1, F16, 128, 4, "auto"),
    ("int4-g32+hk", 128, 1, 2, 101, 3, F16, 4, 20, "tile16"),  # g32 < D/2: tile decode
    ("int8", 64, 2, 3, 77, 5, BF16, 6, 1, "auto"),
    ("int8", 64, 1, 4, 90, 2, F16, 33, 17, "warp16"),
    ("fp16", 64, 1, 4, 63, 1, F16, 0, 0, "auto"),  # the fp16 part: lse only
    ("int4-g32+hk", 64, 1, 2, 150, 40, F16, 17, 4, "prefill16"),  # prefill rows
    ("int4-g32+hk", 64, 1, 2, 150, 40, F16, 17, 4, "auto"),
    ("int8-g16", 80, 1, 3, 70, 21, F16, 5, 3, "auto"),  # odd head dim
    ("fp16", 64, 2, 2, 50, 50, F16, 0, 0, "auto"),  # a whole prompt, lse only
    ("int4+hkv", 64, 1, 2, 90, 2, F16, 8, 4, "auto"),  # values rotated: output back
    ("int8", 64, 1, 1, 33, 33, F16, 1, 1, "prefill16"),  # rows 0, 1 see nothing
    ("int4-g32+hk", 64, 1, 4, 40, 4, F32, 38, 0, "auto"),  # rows 36, 37 see nothing
]


def _id(c) -> str:
    spec, d, h_kv, g, ctx, n_q, dtype, md, mk, kind = c
    return (f"{spec}-D{d}-H{h_kv * g}/{h_kv}-ctx{ctx}-L{n_q}-{str(dtype)[6:]}"
            f"-dist{md}-key{mk}-{kind}")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_lse_and_masks_match_reference(case):
    spec, d, h_kv, g, ctx, n_q, dtype, md, mk, kind = case
    q, view = build(spec, d=d, h_kv=h_kv, group=g, ctx=ctx, n_q=n_q, dtype=dtype, seed=ctx)
    check_lse(q, view, min_distance=md, min_key=mk, kind=kind, what=_id(case))


@pytest.mark.parametrize("n_q", [1, 20])
def test_masks_on_a_wrapped_ring(n_q):
    """A sliding-window layer's body is a quantized ring read at distances >= recent."""
    q, view = build("int4-g32+hk", d=64, h_kv=1, group=2, ctx=90, n_q=n_q, window=32)
    assert view.ring and view.length > view.ring, "ring should have wrapped"
    check_lse(q, view, min_distance=9, what=f"ring-L{n_q}")


@pytest.mark.parametrize("n_q", [1, 24])
def test_softcap_custom_scale_batch2(n_q):
    q, view = build("k8v4", d=64, h_kv=2, group=2, ctx=70, n_q=n_q, batch=2)
    check_lse(q * 8, view, min_distance=12, min_key=4, softcap=5.0, scale=0.2,
              what=f"softcap-L{n_q}")


def test_rows_that_see_nothing_are_zero():
    q, view = build("int8", d=64, h_kv=1, group=2, ctx=30, n_q=3)
    out, lse, seen = check_lse(q, view, min_distance=40, what="nothing-visible")
    assert not seen.any() and bool((out == 0).all())


def test_bad_masks_raise():
    q, view = build("int8", d=64, h_kv=1, group=2, ctx=17, n_q=1)
    with pytest.raises(ShapeError, match="min_distance"):
        triton_attention_lse(q, view, min_distance=-1)


def _hybrid_run(spec, window, chunks, decode_steps, *, seed=0):
    """Fill a HybridCache in prompt chunks then decode steps; after each append, the
    output of hybrid_attention with the kernels forced against the reference."""
    gen = torch.Generator().manual_seed(seed)
    h_kv, group, d = 2, 2, 64
    cache = HybridCache(spec, window=window, max_chunk=max(chunks))
    for n in [*chunks, *([1] * decode_steps)]:
        k = torch.randn(1, h_kv, n, d, generator=gen)
        k[..., :2] *= 6.0  # outlier channels, as real keys have
        v = torch.randn(1, h_kv, n, d, generator=gen)
        q = torch.randn(1, h_kv * group, n, d, generator=gen).to(DEVICE, torch.float16)
        cache.append(k.to(DEVICE, torch.float16), v.to(DEVICE, torch.float16))
        yield q, cache.view()


@pytest.mark.parametrize(
    "spec, window, chunks",
    [("int4-g32+hk@s4r16", None, [23, 23, 24]), ("int8@s2r8", 24, [23, 23, 24]),
     ("k4v8+hkv@s3", None, [17, 20]), ("int4@r5", None, [17, 20])],
    ids=["full-int4-g32+hk@s4r16", "sliding24-int8@s2r8", "sinks-only-k4v8+hkv@s3",
         "recent-only-int4@r5"],
)
def test_hybrid_cache_kernels_match_reference(spec, window, chunks, monkeypatch):
    """HybridCache appended in chunks, then decoded: kernel path == reference path
    (prompt chunks through the parts' chained prefill kernels, or per part where a part
    stores rotated values; decode steps fused: tests/attention/test_hybrid_decode_interp.py)."""
    calls, fused = [], []
    real = triton_api.triton_attention_lse
    real_fused = dispatch_mod.hybrid_decode
    real_chain = dispatch_mod.hybrid_prefill

    def chain(q, view, **kwargs):
        calls.extend(p.min_distance + p.min_key for p in view.parts)
        fused.append(1)
        return real_chain(q, view, **kwargs)

    def spy(*args, **kwargs):
        calls.append(kwargs.get("min_distance", 0) + kwargs.get("min_key", 0))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_api, "triton_attention_lse", spy)
    monkeypatch.setattr(dispatch_mod, "hybrid_decode",
                        lambda *a, **k: fused.append(1) or real_fused(*a, **k))
    monkeypatch.setattr(dispatch_mod, "hybrid_prefill", chain)
    for step, (q, view) in enumerate(_hybrid_run(spec, window, chunks, 3)):
        with monkeypatch.context() as m:
            m.setattr(dispatch_mod, "kernel_unavailable", lambda *a: "forced reference")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the forced reference on CUDA warns
                ref = hybrid_attention(q.float(), view)
        m_calls, m_fused = len(calls), len(fused)
        with monkeypatch.context() as m:
            m.setattr(dispatch_mod, "kernel_unavailable", lambda *a: None)  # CPU: interpreter
            got = hybrid_attention(q, view)
        if q.shape[2] <= 16:  # decode rows: one fused call
            assert (len(calls), len(fused)) == (m_calls, m_fused + 1), "decode not fused"
        else:  # one chain, or each part on the kernels (rotated values)
            chained = not any(p.view.spec.rotate_values for p in view.parts)
            assert len(fused) == m_fused + chained, "prefill not chained"
            assert len(calls) == m_calls + len(view.parts), "every part should use the kernels"
        assert got.dtype == q.dtype
        atol, rel = TOLERANCE[q.dtype]
        ke.assert_close(got.float(), ref, atol=atol, rel_rms=rel, what=f"{spec} step {step}")
    assert max(calls) > 0, "the body part was never read with its masks"


def test_cpu_dispatch_stays_on_the_reference(monkeypatch):
    """CPU tensors (no interpreter request) take attention_lse without a warning."""
    (q, view), = list(_hybrid_run("int4-g32+hk@s4r16", None, [20], 0))
    if ke.HAS_CUDA:
        pytest.skip("CPU dispatch")

    def boom(*a, **k):
        raise AssertionError("kernels called on CPU")

    monkeypatch.setattr(triton_api, "triton_attention_lse", boom)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = part_attention(q, view.parts[-1])
    assert out.shape == q.shape and lse.shape == q.shape[:3]


@pytest.mark.gpu
def test_cuda_hybrid_uses_kernels_without_warning(monkeypatch):
    """A 300-row prompt over a hybrid cache on CUDA: the parts' chained prefill kernels
    (`hybrid_prefill`), one launch per part at least, no fallback warning."""
    calls = []
    real = launch.launch_attention
    monkeypatch.setattr(launch, "launch_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    (q, view), = list(_hybrid_run("int4-g32+hk@s4r128", None, [300], 0))
    assert dispatch_mod.hybrid_prefill_reason(q, view) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hybrid_attention(q, view)
    assert len(calls) >= len(view.parts)
