"""The baselines' captured form (every physical slot behind a mask computed from the device
length) computes what their eager form (the held slots, host length) computes, the runner
captures them when the cache is presized, and the row names the SDPA backend.

Bug these guard against: the stock fp16 arm decoded eagerly on CUDA (a whole model's
launch overhead at 64.6-87.1 ms/token against kvtax's 4.16-7.93, Llama-3.1-8B shapes,
4k-128k) because the baselines read `view.length` on the host and could not be captured.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.cache import FullCache, SlidingCache
from kvtax.attention.baselines import (
    ATTENTION_PATHS, attention_dequant, attention_sdpa, attention_sdpa_folded, sdpa_arguments,
    sdpa_backend,
)
from kvtax.harness.bench.hooks import use_attention, use_sdpa_backend
from kvtax.attention.masks import capacity_mask
from kvtax.models import Runner, load_model
from kvtax.models.decode_graph import clear_unwritten, decode_step_fn, graph_blocker
from tests.support.tensors import assert_close, rand_kv

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

BASELINES = ("unfused", "dequant", "fp16")
FNS = {**ATTENTION_PATHS, "fp16-folded": attention_sdpa_folded}  # + GQA folded into rows
CHUNK = 16  # appends of <= 16 tokens: the rings below (55 and 31 slots) wrap past 63 tokens
_GEOMETRIES = {
    "full": lambda kv: FullCache(kv, capacity=257 + 37),
    "ring": lambda kv: SlidingCache(kv, window=40, sinks=3, max_chunk=CHUNK),
    "ring-nosink": lambda kv: SlidingCache(kv, window=16, max_chunk=CHUNK),
}
_KVS = {"fp16": ("fp16",), "fp16-folded": ("fp16",), "unfused": ("int8", "int4", "k8v4"),
        "dequant": ("int8", "int4+hk")}


def _fill_unwritten(cache, value: float | None, gen: torch.Generator) -> None:
    """Write finite garbage (or `value`, e.g. NaN) into every slot the cache has not filled."""
    held = cache.view().num_slots
    for t in cache.store.k.parts() + cache.store.v.parts():
        tail = t[:, :, held:]
        if value is not None:
            tail.copy_(torch.full(tail.shape, value).to(t.dtype))
        elif t.is_floating_point():
            tail.copy_((torch.randn(tail.shape, generator=gen) * 300).to(t.dtype))
        else:
            tail.copy_(torch.randint(0, 255, tail.shape, generator=gen).to(t.dtype))


def _captured(view):
    lens = torch.full((view.batch,), view.length, dtype=torch.int32)
    return dataclasses.replace(view, length_t=lens)


_PARAMS = [
    pytest.param(path, kv, geo, n, n_q, id=f"{path}-{kv}-{geo}-L{n}-q{n_q}")
    for path in (*BASELINES, "fp16-folded") for kv in _KVS[path] for geo in _GEOMETRIES
    for n in (1, 63, 257) for n_q in (1, 5) if n_q <= n
]


@pytest.mark.parametrize("path, kv, geo, n, n_q", _PARAMS)
def test_captured_form_equals_host_form(path, kv, geo, n, n_q):
    """Random K/V, GQA 8/2, capacity past the length with garbage in the unwritten slots,
    sliding rings before and after wrap-around: the masked capacity read gives the same
    output as the host-length read."""
    gen = torch.Generator().manual_seed(n * 7 + n_q)
    dtype = torch.float16 if path.startswith("fp16") else torch.float32
    cache = _GEOMETRIES[geo](kv)
    for start in range(0, n, CHUNK):
        t = min(CHUNK, n - start)
        cache.append(rand_kv((2, 2, t, 64), outliers=2, gen=gen, dtype=dtype),
                     rand_kv((2, 2, t, 64), gen=gen, dtype=dtype))
    _fill_unwritten(cache, None, gen)
    q = rand_kv((2, 8, n_q, 64), gen=gen, dtype=dtype)
    fn = FNS[path]
    view = cache.view()
    # the captured form reads more slots than are held: garbage it must mask out
    assert view.k.codes.shape[2] > view.num_slots
    want = fn(q, view)
    got = fn(q, _captured(view))
    # fp16 SDPA with a mask takes another kernel than without: fp16 rounding apart.
    tol = 2e-3 if path.startswith("fp16") else 1e-5
    assert_close(got, want, atol=tol, rel_rms=tol, what=f"{path} {kv} {geo}")


def test_capacity_mask_reads_only_the_device_length():
    """Two rows of one batch at different device lengths: each row's mask is its own
    length's (the host length plays no part)."""
    cache = FullCache("fp16", capacity=64)
    cache.append(torch.randn(2, 1, 20, 8), torch.randn(2, 1, 20, 8))
    view = dataclasses.replace(cache.view(), length=999,
                               length_t=torch.tensor([7, 20], dtype=torch.int32))
    mask = capacity_mask(1, view, causal=True)
    assert mask.shape == (2, 1, 1, view.k.codes.shape[2])
    assert mask[0, 0, 0].nonzero().view(-1).tolist() == list(range(7))
    assert mask[1, 0, 0].nonzero().view(-1).tolist() == list(range(20))


def _prefilled(name: str, kv: str, n: int, capacity: int | None, seed: int = 0):
    model = load_model(name, dtype=torch.float32, seed=3)
    runner = Runner(model, kv=kv, chunk_size=32)
    caches = runner.make_caches(capacity=capacity)
    ids = torch.randint(0, model.config.vocab_size, (1, n),
                        generator=torch.Generator().manual_seed(seed))
    logits = runner.prefill(ids, caches)
    return model, runner, caches, logits


@pytest.mark.parametrize("path", BASELINES)
def test_graph_blocker_lets_presized_baselines_through(path):
    kv = "fp16" if path == "fp16" else "int8"
    model, _, caches, _ = _prefilled("tiny", kv, 20, capacity=40)
    _, _, growable, _ = _prefilled("tiny", kv, 20, capacity=None)
    with use_attention(model, ATTENTION_PATHS[path]):
        assert graph_blocker(model, caches) is None
        assert "may grow" in graph_blocker(model, growable)
    with use_attention(model, lambda q, view, **kw: ATTENTION_PATHS[path](q, view, **kw)):
        assert "reads the cache length on the host" in graph_blocker(model, caches)


def test_graph_blocker_refuses_the_fp16_path_over_a_quantized_cache():
    model, _, caches, _ = _prefilled("tiny", "int8", 20, capacity=40)
    with use_attention(model, ATTENTION_PATHS["fp16"]):
        assert "needs an unquantized cache" in graph_blocker(model, caches)


@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3"])
@pytest.mark.parametrize("path", BASELINES)
def test_captured_decode_step_equals_eager_decode(name, path):
    """The exact step a CUDA graph captures (`decode_step_fn`: K/V written at a device
    position, lengths from a device tensor), run eagerly here, gives eager decode's logits
    step after step; tiny-gemma3's sliding layers (window 64) wrap during the prompt."""
    kv = "fp16" if path == "fp16" else "int8"
    n, steps = 90, 6
    model, runner, eager, logits = _prefilled(name, kv, n, capacity=n + steps + 2)
    *_, captured, _ = _prefilled(name, kv, n, capacity=n + steps + 2)
    tokens = torch.zeros(1, 1, dtype=torch.long)
    pos, length = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.int32)
    tok = logits.argmax(-1, keepdim=True)
    with use_attention(model, ATTENTION_PATHS[path]), torch.inference_mode():
        clear_unwritten(model, captured)
        step = decode_step_fn(model, captured, tokens, pos, length)
        for i in range(steps):
            want = runner.decode_step(tok, eager)
            tokens.copy_(tok)
            pos.fill_(captured[0].length)
            length.fill_(captured[0].length + 1)
            got = step()
            for c in captured:
                c.advance(1)
            assert_close(got, want, atol=2e-3, rel_rms=1e-3, what=f"{name} {path} step {i}")
            tok = want.argmax(-1, keepdim=True)


def test_clear_unwritten_keeps_nan_storage_out_of_the_masked_read():
    """torch.empty storage may hold NaN; a mask does not cancel NaN (NaN · 0), so before
    capturing a baseline the runner zeroes the slots no token was written to."""
    model, _, caches, _ = _prefilled("tiny", "int8", 20, capacity=40)
    gen = torch.Generator().manual_seed(0)
    for c in caches:
        _fill_unwritten(c, float("nan"), gen)
    view = caches[0].view()
    q = torch.randn(1, 4, 1, view.head_dim)
    assert torch.isnan(ATTENTION_PATHS["dequant"](q, _captured(view))).all()
    with use_attention(model, ATTENTION_PATHS["dequant"]):
        clear_unwritten(model, caches)
    out = ATTENTION_PATHS["dequant"](q, _captured(caches[0].view()))
    assert_close(out, ATTENTION_PATHS["dequant"](q, view), atol=1e-5, rel_rms=1e-5)


def test_sdpa_backend_names_what_the_dispatcher_picks():
    cache = FullCache("fp16", capacity=80)
    cache.append(torch.randn(1, 2, 50, 64).half(), torch.randn(1, 2, 50, 64).half())
    q = torch.randn(1, 8, 1, 64)
    assert sdpa_backend("unfused", q, cache.view()) is None
    assert sdpa_backend("fused", q, cache.view()) is None
    auto = sdpa_backend("fp16", q, cache.view())
    assert auto in ("flash", "math", "efficient", "cudnn")
    with use_sdpa_backend("math"):
        assert sdpa_backend("fp16", q, cache.view()) == "math"
        assert sdpa_backend("fp16", q, _captured(cache.view()), fold_gqa=True) == "math"
        assert sdpa_backend("dequant", q, _captured(cache.view())) == "math"
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        with use_sdpa_backend("fastest"):
            pass


def test_pinned_backend_really_runs_and_refuses_what_it_cannot_serve():
    """use_sdpa_backend pins the kernel: under math the fp16 path's output is math's; a
    backend that cannot serve the call raises instead of falling back."""
    cache = FullCache("fp16", capacity=80)
    cache.append(torch.randn(1, 2, 50, 64).half(), torch.randn(1, 2, 50, 64).half())
    _fill_unwritten(cache, None, torch.Generator().manual_seed(1))  # finite garbage
    q = torch.randn(1, 8, 1, 64).half()
    view = _captured(cache.view())
    with use_sdpa_backend("math"):
        out = ATTENTION_PATHS["fp16"](q, view)
    assert_close(out, ATTENTION_PATHS["fp16"](q, cache.view()), atol=2e-3, rel_rms=2e-3)
    with use_sdpa_backend("cudnn"), pytest.raises(RuntimeError):
        ATTENTION_PATHS["fp16"](q, view)  # no cuDNN attention on a CPU tensor


_GPU_CASES = [
    pytest.param(name, path, backend, False, id=f"{name}-{path}-{backend}")
    for name in ("tiny", "tiny-gemma3") for path in (*BASELINES, "fp16-folded")
    for backend in {"fp16": ("auto", "math"), "fp16-folded": ("auto", "efficient")}.get(
        path, ("auto",))
] + [pytest.param("tiny", "fp16", "auto", True, id="tiny-fp16-auto-compiled"),
     pytest.param("tiny", "fp16-varlen", "auto", False, id="tiny-fp16-varlen")]


@pytest.mark.gpu
def test_a_pinned_backend_that_cannot_serve_the_call_refuses_it():
    """Pinned to the efficient backend, the captured fp16 baseline with the query heads kept
    (GQA by enable_gqa under a dense mask, which that backend does not serve in torch 2.11)
    raises instead of falling back; the folded form serves it."""
    cache = FullCache("fp16", capacity=64)
    k = torch.randn(1, 2, 40, 64, dtype=torch.float16, device="cuda")
    cache.append(k, k)
    q = torch.randn(1, 8, 1, 64, dtype=torch.float16, device="cuda")
    lens = torch.full((1,), 40, dtype=torch.int32, device="cuda")
    view = dataclasses.replace(cache.view(), length_t=lens)
    with use_sdpa_backend("efficient"):
        folded = FNS["fp16-folded"](q, view)
        with pytest.raises(RuntimeError, match="available kernel"):
            ATTENTION_PATHS["fp16"](q, view)
    assert_close(folded, ATTENTION_PATHS["fp16"](q, cache.view()), atol=2e-3, rel_rms=2e-3)


def _gpu_fn(path: str):
    from kvtax.attention.varlen import attention_sdpa_varlen

    return attention_sdpa_varlen if path == "fp16-varlen" else FNS[path]


@pytest.mark.gpu
@pytest.mark.parametrize("name, path, backend, compiled", _GPU_CASES)
def test_cuda_graph_decode_with_a_baseline_equals_eager(name, path, backend, compiled):
    """A model decode captured with each baseline (and each pinned SDPA backend) gives
    eager decode's logits, teacher-forced step after step, and really replays a graph."""
    kv = "fp16" if path.startswith("fp16") else "int8"
    if path == "fp16-varlen" and "seqused_k" not in str(
            torch.ops.aten._flash_attention_forward.default._schema):
        pytest.skip(f"torch {torch.__version__}'s flash op takes no seqused_k")
    model = load_model(name, dtype=torch.bfloat16, device="cuda", seed=3)
    prompt = torch.randint(0, model.config.vocab_size, (1, 150),
                           generator=torch.Generator().manual_seed(0)).cuda()
    eager = Runner(model, kv=kv, chunk_size=64, cuda_graph=False)
    graph = Runner(model, kv=kv, chunk_size=64, compile=compiled)
    with use_attention(model, _gpu_fn(path)), torch.inference_mode():
        ref, cap = eager.make_caches(capacity=200), graph.make_caches(capacity=200)
        tok = eager.prefill(prompt, ref).argmax(-1, keepdim=True)
        graph.prefill(prompt, cap)
        for i in range(24):
            want = eager.decode_step(tok, ref)  # torch's choice: eager GQA is flash's
            with use_sdpa_backend(backend):  # the pin binds when the graph is captured
                got = graph.decode_step(tok, cap)
            # bf16 model; eager SDPA takes flash, the captured masked call another kernel
            # (on CPU in bf16 the two forms differ by up to 1.2e-2 rel RMS, 1.4e-2 max abs)
            assert_close(got, want, atol=6e-2, rel_rms=3e-2, what=f"step {i}")
            tok = want.argmax(-1, keepdim=True)
    assert graph.graph_captured(greedy=False) and graph.graph_disabled_reason is None


def test_varlen_arm_is_sdpa_eagerly_and_says_why_it_cannot_be_captured_on_cpu():
    from kvtax.attention.varlen import attention_sdpa_varlen, varlen_blocker

    cache = FullCache("fp16", capacity=80)
    cache.append(torch.randn(1, 2, 50, 64), torch.randn(1, 2, 50, 64))
    q = torch.randn(1, 8, 1, 64)
    assert torch.equal(attention_sdpa_varlen(q, cache.view()),
                       ATTENTION_PATHS["fp16"](q, cache.view()))
    assert "CUDA" in varlen_blocker(q, _captured(cache.view()))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        attention_sdpa_varlen(q, _captured(cache.view()))


@pytest.mark.parametrize("path", ["fp16", "dequant"])
def test_lower_right_bias_is_the_host_mask_of_a_full_cache(path):
    """`lower_right=True` (benchmarks/attention.py's prefill arms under the flash backend)
    hands SDPA torch's lower-right causal bias instead of the bool host mask, and computes
    the same attention: a 7-row chunk at the end of 40 tokens of a full cache."""
    from torch.nn.attention.bias import CausalBias

    gen = torch.Generator().manual_seed(5)
    cache = FullCache("fp16" if path == "fp16" else "int8", capacity=64)
    k, v = (rand_kv((1, 2, 40, 64), gen=gen) for _ in range(2))
    cache.append(k, v)
    view = cache.view()
    q = torch.randn(1, 4, 7, 64, generator=gen)
    fn = attention_sdpa if path == "fp16" else attention_dequant
    want = fn(q, view)
    got = fn(q, view, lower_right=True)
    assert_close(got, want, atol=1e-5, rel_rms=1e-5)
    kv = view.k.codes[:, :, :40].float()
    (_, _, _), kw = sdpa_arguments(q, kv, kv, view, None, True, lower_right=True)
    assert isinstance(kw["attn_mask"], CausalBias)
    (_, _, _), kw = sdpa_arguments(q[:, :, -1:], kv, kv, view, None, True, lower_right=True)
    assert kw["attn_mask"] is None  # one decode row sees every key: no mask at all
