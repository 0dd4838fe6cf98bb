"""Fused hybrid-cache decode (`dispatch.hybrid_decode`): each part's split kernel writes into
one shared workspace and one reduce writes the output, against the torch reference (each
part's `attention_lse`, merged by `merge_lse`); plus the swap kernels' hybrid masks.

Small shapes through Triton's interpreter on CPU (tests/conftest.py), compiled on a GPU.
Every fused call is checked to have taken the fused path: the per-part path raises, and
the Triton launches are counted (one split kernel per part plus one reduce).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention import dispatch as dispatch_mod
from kvtax.attention import launch, parts_plan, support
from kvtax.attention.dispatch import attention, hybrid_decode_reason
from kvtax.attention.kernels import decode, decode_swap, decode_warp, reduce
from kvtax.attention.lse import attention_lse, merge_lse
from kvtax.attention.triton_api import swap_decode_config, triton_attention_lse
from kvtax.cache.hybrid import HybridCache
from tests.attention.test_kernels_lse_interp import LSE_TOLERANCE
from tests.support import kernels as ke
from tests.support.channel import channel_view
from tests.support.fused import fused_only
from tests.support.kernels import DEVICE, TOLERANCE, build

pytestmark = pytest.mark.kernels

SPLIT_KERNELS = (decode_warp.decode_warp_kernel, decode.decode_attn_split_kernel,
                 decode_swap.decode_swap_kernel)


@pytest.fixture(autouse=True)
def _poison_workspace(monkeypatch):
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)  # unwritten split slots show


@pytest.fixture
def launches(monkeypatch):
    """The fused path only (tests/support/fused.py): one split kernel per part plus one
    reduce are counted."""
    gluon = support.gluon_swap_kernel()  # CUDA: q4's body runs there
    split = (*SPLIT_KERNELS, *(() if isinstance(gluon, str) else (gluon,)))
    return fused_only(monkeypatch, {"split": split,
                                    "reduce": [reduce.decode_attn_reduce_kernel]})


def _hybrid(spec, *, d, group, ctx, n_q, batch=2, h_kv=2, window=None, seed=0):
    """q `[batch, h_kv * group, n_q, d]` fp16 and a HybridCache of `ctx` tokens (filled in
    two chunks so the fp16 ring has wrapped when ctx is long)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, h_kv, ctx, d, generator=gen)
    k[..., :2] *= 6.0  # outlier channels, as real keys have
    v = torch.randn(batch, h_kv, ctx, d, generator=gen)
    q = torch.randn(batch, h_kv * group, n_q, d, generator=gen).to(DEVICE, torch.float16)
    cache = HybridCache(spec, window=window, max_chunk=ctx)
    first = ctx // 2 or ctx
    for lo, hi in ((0, first), (first, ctx)):
        if hi > lo:
            cache.append(k[:, :, lo:hi].to(DEVICE, torch.float16),
                         v[:, :, lo:hi].to(DEVICE, torch.float16))
    return q, cache.view()


def _reference(q, view, **kw):
    """merge_lse of each part's torch attention_lse (float32 queries)."""
    parts = [attention_lse(q.float(), p.view, min_distance=p.min_distance, min_key=p.min_key,
                           **kw) for p in view.parts]
    return merge_lse(parts)[0]


# (spec, head_dim, group, ctx, n_q, window): contexts below sinks + recent, not multiples
# of 64, and past the ring; q4 = k4w-c64v4@s4r128
CASES = [
    ("q4", 64, 1, 3, 1, None),        # shorter than the sinks: the body sees nothing
    ("q4", 64, 7, 100, 3, None),      # shorter than sinks + recent
    ("q4", 128, 1, 200, 1, None),
    ("q4", 128, 7, 333, 1, None),
    ("q4", 64, 1, 270, 3, None),
    ("k4-c64v4@s4r64", 64, 7, 197, 3, None),
    ("k4w-c64v4@s4r128", 128, 4, 333, 1, None),   # int4w-c64 body: its channel order
    ("int4-g32+hk@s4r16", 64, 7, 90, 3, None),   # rotated keys: q H for the body
    ("int4+hkv@s2r16", 128, 1, 77, 1, None),     # rotated values: fp16 partials rotated
    ("int8@s2r8", 64, 1, 70, 3, 24),             # a sliding layer: the body is a ring
    ("k4-c64v4@r64i8", 64, 2, 333, 1, 200),      # q4 on a sliding layer: an int8 ring
    ("k4-c64v4-g128@r64i8", 256, 4, 333, 1, 200),  # q4 there at Gemma-3's head_dim: V g128
]


def _id(c) -> str:
    spec, d, g, ctx, n_q, window = c
    return f"{spec}-D{d}-G{g}-ctx{ctx}-L{n_q}" + (f"-w{window}" if window else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_decode_matches_reference(case, launches, monkeypatch):
    spec, d, g, ctx, n_q, window = case
    q, view = _hybrid(spec, d=d, group=g, ctx=ctx, n_q=n_q, window=window, seed=ctx)
    assert hybrid_decode_reason(q, view) is None
    folded = []  # CUDA: q4's two parts may take one launch (`parts_plan.folds`)
    real = parts_plan.folds
    monkeypatch.setattr(parts_plan, "folds", lambda c: folded.append(real(c)) or folded[-1])
    got = attention(q, view)
    assert launches == {"split": len(view.parts) - any(folded), "reduce": 1}, launches
    assert got.dtype == q.dtype and got.shape == q.shape
    atol, rel = TOLERANCE[q.dtype]
    ke.assert_close(got.float(), _reference(q, view), atol=atol, rel_rms=rel, what=_id(case))


def test_fused_decode_softcap_and_scale(launches):
    q, view = _hybrid("k4-c64v4@s4r16", d=64, group=2, ctx=150, n_q=3)
    got = attention(q * 8, view, softcap=5.0, scale=0.2)
    assert launches == {"split": 2, "reduce": 1}
    ke.assert_close(got.float(), _reference(q * 8, view, softcap=5.0, scale=0.2),
                    atol=2e-2, rel_rms=4e-3, what="softcap")


def test_fused_decode_reads_device_lengths(launches):
    """With each part's `length_t` (CUDA-graph decode) the kernels take the length from
    the device: a wrong host length changes nothing."""
    q, view = _hybrid("q4", d=64, group=2, ctx=230, n_q=1)
    want = _reference(q, view)
    lens = torch.full((2,), view.length, dtype=torch.int32, device=DEVICE)
    parts = tuple(dataclasses.replace(p, view=dataclasses.replace(
        p.view, length=p.view.length + 9, length_t=lens)) for p in view.parts)
    got = attention(q, dataclasses.replace(view, parts=parts))
    ke.assert_close(got.float(), want, atol=2e-2, rel_rms=4e-3, what="device lengths")


def test_prefill_rows_take_the_prefill_chain(monkeypatch):
    """More than 16 query rows: no fused decode; the parts' prefill kernels serve them
    (dispatch.hybrid_prefill, tests/attention/test_hybrid_prefill_interp.py)."""
    q, view = _hybrid("q4", d=64, group=1, ctx=150, n_q=20)
    monkeypatch.setattr(dispatch_mod, "kernel_unavailable", lambda *a: None)
    assert "prefill" in hybrid_decode_reason(q, view)
    assert dispatch_mod.hybrid_prefill_reason(q, view) is None
    got = attention(q, view)
    ke.assert_close(got.float(), _reference(q, view), atol=2e-2, rel_rms=4e-3, what="prefill")


def test_cpu_without_kernels_keeps_the_reference():
    if ke.HAS_CUDA:
        pytest.skip("CPU dispatch")
    q, view = _hybrid("q4", d=64, group=1, ctx=40, n_q=1)
    assert "CUDA" in hybrid_decode_reason(q, view)


# q4's two parts in one launch (`parts_plan.folds`: the swap kernel's first programs read
# the fp16 part; its Triton twin here, the Gluon kernel on CUDA where it serves the body).
# (spec, head_dim, group, ctx, n_q, chunk): shorter than the sinks, than sinks + window,
# and (32-token chunks: a ring of window + 31 slots) past several wraps of the ring's slots;
# 1-4 query rows per KV head
FOLD_CASES = [
    ("q4", 128, 4, 3, 1, None),
    ("q4", 64, 2, 100, 2, None),
    ("q4", 128, 1, 333, 4, 32),
    ("k4-c64v4@s4r16", 64, 4, 150, 1, 32),
]


def _chunked(spec, *, d, group, ctx, n_q, chunk, batch=2, h_kv=2, seed=0):
    """As `_hybrid`, the cache filled `chunk` tokens at a time (its ring sized for them)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(batch, h_kv, ctx, d, generator=gen) for _ in range(2))
    q = torch.randn(batch, h_kv * group, n_q, d, generator=gen).to(DEVICE, torch.float16)
    cache = HybridCache(spec, max_chunk=chunk)
    for t0 in range(0, ctx, chunk):
        cache.append(k[:, :, t0:t0 + chunk].to(DEVICE, torch.float16),
                     v[:, :, t0:t0 + chunk].to(DEVICE, torch.float16))
    return q, cache.view()


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", FOLD_CASES, ids=lambda c: "{}-D{}-G{}-ctx{}-L{}".format(*c))
def test_folded_parts_match_reference(case, splits, launches, monkeypatch):
    spec, d, g, ctx, n_q, chunk = case
    if chunk is None:
        q, view = _hybrid(spec, d=d, group=g, ctx=ctx, n_q=n_q, seed=ctx)
    else:
        q, view = _chunked(spec, d=d, group=g, ctx=ctx, n_q=n_q, chunk=chunk, seed=ctx)
        assert ctx > view.parts[0].view.sinks + 2 * view.parts[0].view.ring  # wrapped twice
    folded = []

    def folds(checked):  # as `folds` where the body takes kernel "swap"
        ring, body = checked
        ring.cfg = dataclasses.replace(ring.cfg, num_splits=splits)
        body.cfg = swap_decode_config(body.q, body.view)
        folded.append(body.cfg.num_splits)
        return True

    monkeypatch.setattr(parts_plan, "folds", folds)
    got = attention(q, view)
    assert folded and launches == {"split": 1, "reduce": 1}, launches
    atol, rel = TOLERANCE[q.dtype]
    ke.assert_close(got.float(), _reference(q, view), atol=atol, rel_rms=rel,
                    what=f"{case} {splits} splits")


# swap kernels with the hybrid body's masks (the Gluon kernel's CUDA path reads the same
# min_distance / min_key; its Triton twin runs here). (value, d, group, ctx, n_q, md, mk)
SWAP_CASES = [
    ("int4", 128, 4, 300, 1, 128, 4),   # q4's body at Llama's GQA
    ("int4", 64, 1, 150, 3, 17, 40),    # min_key past the first 32-slot step
    ("int4", 64, 2, 70, 2, 64, 4),      # the body holds a handful of keys
    ("int8", 64, 4, 40, 1, 128, 4),     # the body is empty: every row lse -inf
]


def _check_swap_masks(q, view, min_distance, min_key, *, what):
    """Kernel "swap" (explicit config) vs attention_lse: out, lse, empty rows -inf."""
    out, lse = triton_attention_lse(q, view, min_distance=min_distance, min_key=min_key,
                                    config=swap_decode_config(q, view))
    ref_out, ref_lse = attention_lse(q.float(), view, min_distance=min_distance,
                                     min_key=min_key)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{what}: rows with / without keys differ"
    atol, rel = TOLERANCE[q.dtype]
    ke.assert_close(out, ref_out, atol=atol, rel_rms=rel, what=f"{what} out")
    if seen.any():
        atol, rel = LSE_TOLERANCE[q.dtype]
        ke.assert_close(lse[seen], ref_lse[seen], atol=atol, rel_rms=rel, what=f"{what} lse")


@pytest.mark.parametrize("case", SWAP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_swap_twin_applies_hybrid_masks(case, monkeypatch):
    value, d, g, ctx, n_q, md, mk = case
    q, view = channel_view(value, d=d, h_kv=2, group=g, ctx=ctx, n_q=n_q, batch=2, seed=ctx)
    calls = []
    fn = decode_swap.decode_swap_kernel
    original = fn.run
    monkeypatch.setattr(fn, "run", lambda *a, **k: calls.append(1) or original(*a, **k))
    # an explicit swap config runs the Gluon kernel where it serves the call: not here
    monkeypatch.setattr(launch, "gluon_swap_reason", lambda *a: "twin under test")
    _check_swap_masks(q, view, md, mk, what=str(case))
    assert calls, "decode_swap.py did not run"


def test_swap_twin_plain_int_keys_with_masks(monkeypatch):
    """Per-token int8 keys (not c64) through the twin's masked head, full and tail loops."""
    q, view = build("int8", d=64, h_kv=1, group=4, ctx=190, n_q=1, seed=3)
    monkeypatch.setattr(launch, "gluon_swap_reason", lambda *a: "twin under test")
    _check_swap_masks(q, view, 33, 37, what="int8 twin masks")


def _args(kernel, **cfg):
    from types import SimpleNamespace

    from kvtax.attention.launch_table import LaunchConfig

    return SimpleNamespace(q=torch.empty(1), cfg=LaunchConfig("decode", 16, 32, 1, 2, 4,
                                                              kernel=kernel, **cfg))


def test_swap_parts_run_beside_the_fp16_part_under_pdl(monkeypatch):
    """Under PDL the fp16 part launches normally and lets the body launch first thing; the
    body (kernel "swap") runs beside it and keeps its own end-of-kernel trigger."""
    monkeypatch.setattr(launch.pdl, "enabled", lambda kind, t, interp: True)
    ring, body = parts_plan.beside([_args("warp", pdl_launch=True),
                                 _args("swap", pdl_launch=False, pdl_late=True)])
    assert (ring.cfg.pdl_launch, ring.cfg.pdl_late, ring.cfg.pdl_beside) == (False, False, False)
    assert (body.cfg.pdl_launch, body.cfg.pdl_late, body.cfg.pdl_beside) == (True, True, True)
    opts = launch.pdl_options("attention", torch.empty(1), body.cfg)
    assert (opts["launch_pdl"], opts["PDL_BESIDE"]) == (True, True)
    assert "PDL_BESIDE" not in launch.pdl_options("attention", torch.empty(1), ring.cfg)


def _room_parts(ring_splits, body_splits, per_sm=8, beside=True):
    """A fp16 ring part and a body, 2 KV heads, on CPU tensors (4 SMs: launch_table)."""
    from types import SimpleNamespace

    ring = _args("warp")
    body = _args("swap", per_sm=per_sm, pdl_beside=beside)
    for a, n in ((ring, ring_splits), (body, body_splits)):
        a.cfg = dataclasses.replace(a.cfg, num_splits=n)
        a.q, a.view = torch.empty(1, 8, 1, 64), SimpleNamespace(num_kv_heads=2)
    return [ring, body]


def test_the_body_makes_room_for_the_fp16_part_where_both_fill_every_sm():
    """16 body splits x 2 heads fill 4 SMs at 8 programs each: the ring's 3 splits per
    head go to 2 (ROOM_SPLITS), and the body gives up two splits (4 programs) for them."""
    ring, body = parts_plan.make_room(_room_parts(3, 16))
    assert (ring.cfg.num_splits, body.cfg.num_splits) == (2, 14)


def test_a_part_with_fewer_splits_keeps_them_when_the_body_makes_room():
    """One ring split per head stays one; the body gives up one split (2 programs)."""
    ring, body = parts_plan.make_room(_room_parts(1, 16))
    assert (ring.cfg.num_splits, body.cfg.num_splits) == (1, 15)


@pytest.mark.parametrize("case", [dict(body_splits=10), dict(per_sm=12), dict(beside=False)])
def test_parts_keep_their_splits_where_they_fit_or_were_not_measured(case):
    """Room to spare (20 + 6 programs of 32), a body at 12 per SM (measured slower with
    the change), or parts run one after the other (no PDL): nothing changes."""
    kw = dict(ring_splits=3, body_splits=16) | case
    ring, body = parts_plan.make_room(_room_parts(**kw))
    assert (ring.cfg.num_splits, body.cfg.num_splits) == (3, kw["body_splits"])


def _fold_parts(spec="q4", **change):
    """q4's planned parts as `launch_parts_decode` holds them (the body beside the fp16
    part), a Gluon kernel taken to serve the body; `change`: one condition broken."""
    from types import SimpleNamespace

    q, view = _hybrid(spec, d=128, group=4, ctx=300, n_q=1)
    lengths = torch.full((2,), 300, dtype=torch.int32)
    ring, body = (SimpleNamespace(q=q, view=p.view, lengths=lengths, softcap=False,
                                  qk_scale=0.125, masks=dict(min_dist=p.min_distance,
                                                             min_key=p.min_key))
                  for p in view.parts)
    ring.cfg = _args("warp").cfg
    body.cfg = _args("swap", pdl_beside=True).cfg
    for key, value in change.items():
        part, attr = key.split("_", 1)
        setattr(ring if part == "ring" else body, attr, value)
    return [ring, body]


@pytest.mark.parametrize("change", [
    {}, dict(body_cfg=_args("swap").cfg), dict(body_cfg=_args("warp", pdl_beside=True).cfg),
    dict(body_softcap=True), dict(ring_lengths=None), dict(ring_qk_scale=0.2),
    dict(ring_masks=dict(min_dist=3, min_key=0)), dict(ring_q=torch.zeros(2, 8, 1, 128)),
], ids=["folds", "not-beside", "body-not-swap", "softcap", "other-lengths", "other-scale",
        "ring-masked", "other-queries"])
def test_parts_fold_only_where_the_fused_kernel_reads_both(change, monkeypatch):
    """`folds`: q4's planned pair folds; each broken condition keeps two launches."""
    monkeypatch.setattr(parts_plan, "gluon_swap_reason", lambda q, view: None)
    assert parts_plan.folds(_fold_parts(**change)) == (not change)


def test_parts_do_not_fold_when_switched_off_or_not_q4(monkeypatch):
    monkeypatch.setattr(parts_plan, "gluon_swap_reason", lambda q, view: None)
    monkeypatch.setattr(parts_plan, "FOLD", False)
    assert not parts_plan.folds(_fold_parts())  # KVTAX_FOLD=0
    monkeypatch.setattr(parts_plan, "FOLD", True)
    assert not parts_plan.folds(_fold_parts("k4-c64v4@r64i8"))  # recent tokens in int8
    monkeypatch.setattr(parts_plan, "gluon_swap_reason", lambda q, view: "no Gluon here")
    assert not parts_plan.folds(_fold_parts())


def test_a_short_part_reads_one_tile_per_split():
    """The fp16 part of a hybrid cache (a ring through its window) gets one split per
    tile it reads; the body keeps its own split count."""
    from types import SimpleNamespace

    ring, body = _args("warp"), _args("swap")
    ring.view = SimpleNamespace(ring=2176, window=128, sinks=4, num_slots=2180,
                                k=SimpleNamespace(codes=torch.empty(1, 1, 2180, 1)))
    body.view = SimpleNamespace(ring=0, window=None, sinks=0, num_slots=131072,
                                k=SimpleNamespace(codes=torch.empty(1, 1, 131072, 1)))
    ring.lengths = body.lengths = None
    ring.q = body.q = torch.empty(1, 32, 1, 128)
    parts_plan.short_splits([ring, body])
    assert (ring.cfg.num_splits, body.cfg.num_splits) == (7, 4)  # (4 + 128 + 1 + 64) / 32


@pytest.mark.parametrize("kernels", [("warp", "warp"), ("warp", "tile")])
def test_parts_stay_in_order_without_swap_bodies(monkeypatch, kernels):
    monkeypatch.setattr(launch.pdl, "enabled", lambda kind, t, interp: True)
    parts = [_args(k) for k in kernels]
    assert parts_plan.beside(parts) == parts
    assert not any(p.cfg.pdl_beside for p in parts)


def test_parts_stay_in_order_without_pdl():
    parts = [_args("warp"), _args("swap")]
    assert parts_plan.beside(parts) == parts  # CPU tensors: PDL off
    assert not any(p.cfg.pdl_beside for p in parts)
