"""Decode GEMV kernels (RMSNorm prologue, SiLU·up and residual epilogues, split-K) vs the
float32 torch reference, small odd shapes (CPU: Triton interpreter).

On a machine without CUDA tests/conftest.py builds the kernels with TRITON_INTERPRET=1
and they run on CPU tensors.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from kvtax import pdl
from kvtax.errors import OptionError, ShapeError
from kvtax.models import gemv as gm
from kvtax.models.gemv import GemvConfig, default_config, gemv, gemv_reference
from kvtax.models.rope import inv_frequencies, rope_cos_sin
from tests.support.device import DEVICE, HAS_CUDA
from tests.support.tensors import assert_close

pytestmark = pytest.mark.kernels
# (atol as a fraction of the largest |y|, rel RMS) against the float32 reference: the
# kernel accumulates in fp32 and rounds once at the store, so half an ulp of the output
# dtype (fp16 2^-11 relative) plus accumulation order bounds the error. bf16: a whole ulp
# (2^-7 relative), as Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest).
TOLERANCE = {
    torch.bfloat16: (2**-7, 8e-3),
    torch.float16: (2**-10, 1e-3),
    torch.float32: (1e-5, 1e-5),
}


@pytest.fixture(autouse=True)
def _poison_workspace(monkeypatch):
    monkeypatch.setattr(gm, "POISON_WORKSPACE", True)


def _inputs(m, n, k, dtype, *, norm=False, residual=False, silu=False, seed=0, lead=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*(lead or (m,)), k, generator=gen)
    w = torch.randn(2 * n if silu else n, k, generator=gen) / k**0.5
    g = torch.rand(k, generator=gen) + 0.5 if norm else None
    r = torch.randn(*(lead or (m,)), n, generator=gen) if residual else None
    cast = lambda t, dt=dtype: None if t is None else t.to(DEVICE, dt)  # noqa: E731
    return cast(x), cast(w), cast(g, torch.float32 if dtype == torch.float32 else dtype), cast(r)


def _check(x, w, *, what, dtype, **kw):
    n = w.shape[0] // 2 if kw.get("silu_mul") else w.shape[0]
    out = torch.full((*x.shape[:-1], n), float("nan"), dtype=dtype, device=DEVICE)
    got = gemv(x, w, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    kw.pop("config", None)
    ref = gemv_reference(x, w, out_dtype=torch.float32, **kw)
    frac, rel = TOLERANCE[dtype]
    assert_close(got.float(), ref, atol=frac * ref.abs().max().item() + 1e-6, rel_rms=rel,
                 what=what)
    return got


OPTIONS = {
    "plain": {}, "norm": dict(norm=True), "res": dict(residual=True), "silu": dict(silu=True),
    "norm+silu": dict(norm=True, silu=True), "norm+res": dict(norm=True, residual=True),
    "silu+res": dict(silu=True, residual=True),
    "all": dict(norm=True, silu=True, residual=True),
}
ROWS_DTYPE = [(1, torch.bfloat16), (2, torch.float16), (3, torch.float32)]


@pytest.mark.parametrize("split", [1, 3], ids=["split1", "split3"])
@pytest.mark.parametrize("m,dtype", ROWS_DTYPE, ids=[f"M{m}-{str(d)[6:]}" for m, d in ROWS_DTYPE])
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_matches_reference(opt, m, dtype, split):
    """N=37, K=100 with 8x32 tiles: ragged row blocks (clamped rows) and ragged K (masks);
    split 3 cuts K into 64+36 (a split with whole and partial steps) and takes the reduce."""
    o = OPTIONS[opt]
    x, w, g, r = _inputs(m, 37, 100, dtype, seed=m + split, **o)
    _check(x, w, norm_weight=g, residual=r, silu_mul=o.get("silu", False),
           config=GemvConfig(block_n=8, block_k=32, split_k=split), dtype=dtype,
           what=f"{opt}-M{m}-split{split}")


@pytest.mark.parametrize("fold", [2, 8])
@pytest.mark.parametrize("split", [1, 3], ids=["split1", "split3"])
@pytest.mark.parametrize("m,dtype", [(1, torch.bfloat16), (4, torch.float32)], ids=["M1", "M4"])
def test_folded_accumulators_match_reference(m, dtype, split, fold):
    """FOLD (products summed in groups of `fold` columns each step, narrower accumulators)
    with every fusion, ragged K (masked loads) and split-K; and the RoPE launch."""
    x, w, g, r = _inputs(m, 37, 100, dtype, seed=30 + m + fold, norm=True, residual=True,
                         silu=True)
    cfg = GemvConfig(block_n=8, block_k=32, split_k=split, fold=fold)
    _check(x, w, norm_weight=g, residual=r, silu_mul=True, config=cfg, dtype=dtype,
           what=f"fold{fold}-M{m}-split{split}")
    d, t = 16, 2
    x, w, g, _ = _inputs(t, 7 * d, 100, dtype, seed=40 + fold, norm=True, lead=(1, t))
    cos, sin = _rope(t, d, dtype, seed=d)
    _check(x, w, norm_weight=g, rope=(cos, sin, 5 * d), dtype=dtype,
           config=GemvConfig(block_n=8, block_k=32, fold=fold), what=f"fold{fold}-rope")


@pytest.mark.parametrize("split", [1, 3], ids=["split1", "split3"])
@pytest.mark.parametrize("m,dtype", ROWS_DTYPE, ids=[f"M{m}-{str(d)[6:]}" for m, d in ROWS_DTYPE])
def test_bias_with_norm_and_residual(m, dtype, split):
    """Qwen2's qkv bias: added after the norm's scale, before the residual, split or not."""
    x, w, g, r = _inputs(m, 37, 100, dtype, seed=10 + m, norm=True, residual=True)
    b = (torch.randn(37, generator=torch.Generator().manual_seed(m)) * 3).to(DEVICE, dtype)
    for kw in (dict(norm_weight=g), dict(norm_weight=g, residual=r)):
        _check(x, w, bias=b, config=GemvConfig(block_n=8, block_k=32, split_k=split),
               dtype=dtype, what=f"bias-M{m}-split{split}-{sorted(kw)}", **kw)


@pytest.mark.parametrize("split", [1, 3], ids=["split1", "split3"])
@pytest.mark.parametrize("m,dtype", ROWS_DTYPE, ids=[f"M{m}-{str(d)[6:]}" for m, d in ROWS_DTYPE])
def test_gelu_gate_with_offset_norm(m, dtype, split):
    """Gemma's MLP: (1 + w) RMSNorm, then GELU-tanh(gate) · up, split or not."""
    x, w, g, _ = _inputs(m, 37, 100, dtype, seed=20 + m, norm=True, silu=True)
    x = x * 3  # gate values out to |y| ~ 3, where GELU's tanh curve matters
    _check(x, w, norm_weight=g - 1.0, norm_offset=True, silu_mul=True, gelu=True,
           config=GemvConfig(block_n=8, block_k=32, split_k=split), dtype=dtype,
           what=f"gelu-M{m}-split{split}")


@pytest.mark.parametrize("split", [1, 2, 4])
def test_even_shapes_four_rows(split):
    """K a multiple of split x block_k: the unmasked (EVEN_K) loads; M=4, every fusion."""
    x, w, g, r = _inputs(4, 64, 256, torch.bfloat16, norm=True, residual=True, silu=True)
    _check(x, w, norm_weight=g, residual=r, silu_mul=True, dtype=torch.bfloat16,
           config=GemvConfig(block_n=16, block_k=64, split_k=split), what=f"even-split{split}")


def test_default_config_and_batch_shaped_input():
    """[B, 1, K] input (the decoder's decode activations) with the heuristic config."""
    x, w, g, r = _inputs(3, 37, 100, torch.float16, norm=True, residual=True, lead=(3, 1))
    got = _check(x, w, norm_weight=g, residual=r, dtype=torch.float16, what="default-[3,1,K]")
    assert got.shape == (3, 1, 37)
    y = gemv(x[:1, 0], w)  # no out: allocated
    assert y.shape == (1, 37) and not torch.isnan(y).any()


@pytest.mark.parametrize("split", [1, 2])
def test_residual_may_alias_out(split):
    """In-place residual update (h += x @ w.T) as the decoder's residual stream does."""
    x, w, _, r = _inputs(2, 37, 100, torch.bfloat16, residual=True)
    want = gemv_reference(x, w, residual=r, out_dtype=torch.float32)
    h = r.clone()
    got = gemv(x, w, residual=h, out=h, config=GemvConfig(8, 32, split))
    assert got.data_ptr() == h.data_ptr()
    frac, rel = TOLERANCE[torch.bfloat16]
    assert_close(h.float(), want, atol=frac * want.abs().max().item(), rel_rms=rel,
                 what="aliased")


def test_norm_offset_and_eps():
    """Gemma's (1 + g) norm weight and a large eps (the eps must reach the rsqrt)."""
    x, w, g, _ = _inputs(1, 37, 100, torch.float32, norm=True)
    for split in (1, 4):
        _check(x, w, norm_weight=g - 1, norm_offset=True, eps=0.5, dtype=torch.float32,
               config=GemvConfig(8, 32, split), what=f"offset-split{split}")


def test_split_k_more_than_steps_drops_empty_splits():
    """split_k=16 on K=100 with block_k=32 (4 steps): splits that would be empty are
    dropped; the reduce must not read their (NaN-poisoned) partials."""
    x, w, g, r = _inputs(2, 37, 100, torch.float32, norm=True, residual=True)
    _check(x, w, norm_weight=g, residual=r, config=GemvConfig(8, 32, 16), dtype=torch.float32,
           what="split16")


def test_compiled_call_is_one_opaque_op():
    """Inside torch.compile (fullgraph) gemv goes through the kvtax::gemv op and matches eager."""
    x, w, g, r = _inputs(1, 37, 100, torch.bfloat16, norm=True, residual=True, silu=True)
    cfg = GemvConfig(8, 32, 2)

    def step(x, w, g, r):
        return gemv(x, w, norm_weight=g, residual=r, silu_mul=True, config=cfg) * 2

    want = step(x, w, g, r)
    torch._dynamo.reset()
    got = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)(x, w, g, r)
    assert torch.equal(got, want)


def test_default_config_fills_the_gpu():
    """Llama-3.1-8B decode shapes: every SM gets a program, unsplit (the H200 sweep's
    finding), tiles within the register budget; split-K only for a narrow layer."""
    for n, k, silu in ((6144, 4096, False), (4096, 4096, False), (14336, 4096, True),
                       (4096, 14336, False), (128256, 4096, False)):
        for rows in (1, 4):
            c = default_config(n, k, rows=rows, silu_mul=silu)
            programs = -(-n // c.block_n) * c.split_k
            assert programs >= 132 and c.split_k == 1, (n, k, c)
            tiles = rows * (2 if silu else 1)
            # 16+ programs per SM stream 2 KiB per row per step: up to twice the budget;
            # folded tiles keep block_k / fold accumulators per row
            assert c.block_n * c.block_k // c.fold * tiles <= 2 * 32 * 32 * gm.NUM_WARPS, (
                n, k, c)
    assert default_config(6144, 4096).block_n == 8  # qkv: 768 blocks of 8 (5.8 per SM)
    # o, down, gate/up at one row: 2-row blocks, 4 KiB of each row per step, folded by 4
    for n, k, silu in ((4096, 4096, False), (4096, 14336, False), (14336, 4096, True)):
        assert default_config(n, k, silu_mul=silu) == GemvConfig(2, 2048, 1, 4)
    assert default_config(4096, 4096, rows=4).fold == 1  # batch rows: the earlier tiles
    assert default_config(14336, 4096, rows=2, silu_mul=True).fold == 1
    assert default_config(128256, 4096).block_k == 1024  # lm_head
    assert default_config(128256, 4096, rows=4).block_k == 512  # 4 rows: the budget holds
    c = default_config(256, 4096)  # 64 row blocks of 4: split to reach 132 SMs
    assert (c.block_n, c.split_k) == (4, 4) and -(-256 // c.block_n) * c.split_k >= 132


def _rope(t, d, dtype, seed, freqs=False):
    """rope.py's (cos, signed sin) tables `[t, d]` at scattered positions (one past 128k),
    or (freqs) the positions `[t]` and inverse frequencies `[d / 2]` they come from."""
    pos = torch.tensor([5, 131000, 3, 77][:t], device=DEVICE) + seed
    inv = inv_frequencies(d, 10000.0).to(DEVICE)
    return (pos, inv) if freqs else rope_cos_sin(pos, inv, dtype)


@pytest.mark.parametrize("b,t,d,block_n,dtype", [
    (1, 1, 16, 8, torch.bfloat16), (3, 1, 8, 16, torch.bfloat16), (1, 2, 32, 2, torch.bfloat16),
    (2, 2, 16, 8, torch.bfloat16), (2, 2, 8, 16, torch.float32), (3, 1, 32, 2, torch.float32),
])
@pytest.mark.parametrize("freqs", [False, True], ids=["tables", "freqs"])
def test_rope_epilogue(b, t, d, block_n, dtype, freqs):
    """The qkv projection with q and k rotated in the epilogue: 3 q heads, 2 k heads and
    2 v heads of head_dim d (v unrotated); norm and bias fused too; rows b * t with
    position t of each; block_n above d is cut to d, every program owns both halves.
    freqs: the kernel builds the tables from (positions, inv_freq) itself, as
    rope_cos_sin does: the result matches the tables' launch to a rounding of a table
    entry (the interpreter's cos and torch's may differ by an ulp before it)."""
    n, rot = 7 * d, 5 * d
    x, w, g, _ = _inputs(b * t, n, 100, dtype, seed=b + 10 * t, norm=True, lead=(b, t))
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(d)) * 0.5).to(DEVICE, dtype)
    cos, sin = _rope(t, d, dtype, seed=d)
    rope = (*_rope(t, d, dtype, seed=d, freqs=True), rot) if freqs else (cos, sin, rot)
    cfg = GemvConfig(block_n=block_n, block_k=32, split_k=2)
    got = _check(x, w, norm_weight=g, bias=bias, rope=rope, dtype=dtype, config=cfg,
                 what=f"rope-B{b}-T{t}-D{d}")
    plain = gemv(x, w, norm_weight=g, bias=bias, config=GemvConfig(8, 32))
    # v as is (to the FMA contractions the GPU compiler picks for each build)
    torch.testing.assert_close(got[..., rot:], plain[..., rot:])
    assert not torch.allclose(got[..., :rot].float(), plain[..., :rot].float(), atol=1e-2)
    if freqs:
        tabled = gemv(x, w, norm_weight=g, bias=bias, rope=(cos, sin, rot), config=cfg)
        scale = tabled.abs().max().item()
        tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.float(), tabled.float(), rtol=0, atol=tol * scale)


def test_rope_bad_input():
    x, w, g, r = _inputs(2, 48, 100, torch.float32, norm=True, residual=True, lead=(1, 2))
    cos, sin = _rope(2, 16, torch.float32, seed=0)
    bad = {
        "with silu": dict(silu_mul=True, rope=(cos, sin, 16)),
        "with residual": dict(residual=r, rope=(cos, sin, 16)),
        "rows not heads": dict(rope=(cos, sin, 20)),
        "rows past n": dict(rope=(cos, sin, 64)),
        "positions": dict(rope=(cos[:1], sin[:1], 16)),
        "d not pow2": dict(rope=(cos[:, :12], sin[:, :12], 24)),
        "tables differ": dict(rope=(cos, sin[:, :8], 16)),
        "freqs not fp32": dict(rope=(torch.tensor([1, 2], device=DEVICE),
                                     torch.ones(8, device=DEVICE, dtype=torch.float16), 16)),
        "positions 2-d": dict(rope=(torch.ones(2, 1, device=DEVICE, dtype=torch.int64),
                                    torch.ones(8, device=DEVICE), 16)),
        "positions count": dict(rope=(torch.tensor([1, 2, 3], device=DEVICE),
                                      torch.ones(8, device=DEVICE), 16)),
    }
    for what, kw in bad.items():
        with pytest.raises(ShapeError, match="gemv cannot run"):
            gemv(x, w, **kw)
        print(what, "raised")


@pytest.mark.gpu  # programmatic dependent launch: sm_90+ (skips below)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_pdl_chain_matches_plain_launches(graph, monkeypatch):
    """A chain of GEMVs, each reading the one before's output (as in a decode step), gives
    bit-identical results launched with PDL (each waits before reading x) and without;
    in a CUDA graph too (the runner's path). A kernel that read x before its wait would
    see the previous step's values here: the chain runs twice on changing inputs. Both
    wait placements run: first thing (gate/up), after the first W tile (o, qkv)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+")
    x, w1, g, _ = _inputs(1, 4096, 4096, torch.bfloat16, norm=True, silu=True, seed=1)
    w2 = (torch.randn(4096, 4096, device=DEVICE) / 64).to(torch.bfloat16)
    w3 = (torch.randn(6144, 4096, device=DEVICE) / 64).to(torch.bfloat16)

    pos = torch.tensor([70000], device=DEVICE)
    inv = inv_frequencies(128, 500000.0).to(DEVICE)

    def chain(inp):  # gate/up, o-like with the residual, qkv with its RoPE epilogue
        h = gemv(inp, w1, norm_weight=g, silu_mul=True)  # [1, 4096]
        y = gemv(h, w2, residual=inp)
        return gemv(y.view(1, 1, -1), w3, norm_weight=g, rope=(pos, inv, 5120))

    results = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "USE_PDL", on)
        inp = x.clone()
        if graph:
            chain(inp)
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                out = chain(inp)
            outs = []
            for step in range(3):
                inp.copy_(x * (step + 1))
                cg.replay()
                outs.append(out.clone())
        else:
            outs = [chain(x * (step + 1)) for step in range(3)]
        torch.cuda.synchronize()
        results[on] = outs
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)
    assert not torch.equal(results[True][0], results[True][1])


def test_bad_input_raises(monkeypatch):
    x, w, g, r = _inputs(1, 37, 100, torch.float16, norm=True, residual=True)
    bad = {
        "K mismatch": lambda: gemv(x[:, :99], w),
        "5 rows": lambda: gemv(x.expand(5, 100), w),
        "dtype mismatch": lambda: gemv(x, w.float()),
        "int dtype": lambda: gemv(x.to(torch.int32), w.to(torch.int32)),
        "transposed w": lambda: gemv(x[:, :37], w.t()),
        "odd silu rows": lambda: gemv(x, w, silu_mul=True),
        "residual shape": lambda: gemv(x, w, residual=r[:, :36]),
        "residual dtype": lambda: gemv(x, w, residual=r.float()),
        "norm shape": lambda: gemv(x, w, norm_weight=g[:99]),
        "bias shape": lambda: gemv(x, w, bias=g[:36]),
        "bias with silu": lambda: gemv(x[:, :100], torch.cat([w, w]), bias=g[:37], silu_mul=True),
        "out dtype": lambda: gemv(x, w, out=torch.empty(1, 37, device=DEVICE)),
        "out shape": lambda: gemv(x, w, out=torch.empty(1, 38, dtype=x.dtype, device=DEVICE)),
        "w 1-d": lambda: gemv(x, w[0]),
    }
    for what, call in bad.items():
        with pytest.raises(ShapeError, match="gemv cannot run"):
            call()
        print(what, "raised")
    with pytest.raises(OptionError, match="eps"):
        gemv(x, w, eps=0.0)
    with pytest.raises(OptionError, match="silu_mul"):
        gemv(x, w, gelu=True)
    with pytest.raises(OptionError, match="power of two"):
        GemvConfig(block_n=3)
    with pytest.raises(OptionError, match="split_k"):
        GemvConfig(split_k=0)
    with pytest.raises(OptionError, match="fold=3"):
        GemvConfig(fold=3)
    with pytest.raises(OptionError, match="fold=64 must be <= block_k=32"):
        GemvConfig(block_k=32, fold=64)
    assert gm.unsupported_reason(x, w, norm_weight=g, residual=r) is None
    monkeypatch.setattr(gm, "_interpreting", lambda: False)
    if not HAS_CUDA:
        assert "CUDA" in gm.unsupported_reason(x, w)


@pytest.mark.skipif(HAS_CUDA, reason="CPU check of the script; the GPU machine's Triton "
                    "3.6 interpreter fails on runtime loop bounds with NumPy 2")
def test_benchmark_dry_run(tmp_path):
    """benchmarks/gemv.py --dry-run: every arm runs on CPU (interpreter) and writes rows."""
    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gemv.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script), "--dry-run", "--sweep", "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines()]
    bad = [(r["shape"], r["arm"], r["note"]) for r in rows if r["status"] != "ok"]
    assert rows and not bad, bad[:4]
    arms = {r["arm"] for r in rows}
    assert {"cublas", "torch-unfused", "kvtax"} <= arms
    assert any(a.startswith("kvtax@") for a in arms)
    assert all(r["max_abs_err"] < 0.25 for r in rows)
    assert "| shape" in proc.stdout
