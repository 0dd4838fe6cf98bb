"""Fused hybrid-cache decode compiled on CUDA: q4 at Llama-3.1-8B layer shapes against the
torch reference, the launches it makes (profiled: one split kernel per part, the body on
the Gluon kernel, one reduce), and CUDA-graph replay reading device lengths."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention import attention, launch, parts_plan
from kvtax.attention.dispatch import hybrid_decode_reason
from kvtax.attention.lse import attention_lse, merge_lse
from kvtax.cache.hybrid import HybridCache
from tests.support import kernels as ke

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]


def _q4(ctx, *, dtype=torch.float16, group=4, h_kv=8, d=128, batch=1, capacity=None,
        n_q=1):
    """q `[batch, h_kv * group, n_q, d]` and a q4 HybridCache of ctx tokens on CUDA."""
    gen = torch.Generator(device="cuda").manual_seed(ctx)
    k = torch.randn(batch, h_kv, ctx, d, generator=gen, device="cuda")
    k[..., :2] *= 6.0
    v = torch.randn(batch, h_kv, ctx, d, generator=gen, device="cuda")
    cache = HybridCache("q4", capacity=capacity, max_chunk=4096)
    for t0 in range(0, ctx, 4096):
        cache.append(k[:, :, t0:t0 + 4096].to(dtype), v[:, :, t0:t0 + 4096].to(dtype))
    q = torch.randn(batch, h_kv * group, n_q, d, generator=gen, device="cuda").to(dtype)
    return q, cache


def _reference(q, view):
    return merge_lse([attention_lse(q.float(), p.view, min_distance=p.min_distance,
                                    min_key=p.min_key) for p in view.parts])[0]


@pytest.mark.parametrize("ctx", [70, 200, 4097, 70000])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_q4_fused_decode_matches_reference(ctx, dtype):
    q, cache = _q4(ctx, dtype=dtype, batch=2)
    view = cache.view()
    assert hybrid_decode_reason(q, view) is None
    atol, rel = ke.TOLERANCE[dtype]
    ke.assert_close(attention(q, view).float(), _reference(q, view), atol=atol, rel_rms=rel,
                    what=f"q4 ctx {ctx} {dtype}")


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "unfolded"])
def test_q4_fused_decode_launches(fold, monkeypatch):
    """Folded (`parts_plan.folds`): the Gluon kernel reads both parts, then the reduce;
    unfolded: the fp16 ring on decode_warp, the body on the Gluon kernel, the reduce."""
    monkeypatch.setattr(parts_plan, "FOLD", fold)
    q, cache = _q4(8192)
    view = cache.view()
    attention(q, view)  # compile outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        attention(q, view)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(names) == (2 if fold else 3), names
    assert any("decode_swap_gluon" in n for n in names), names  # the masked body
    assert any("decode_warp" in n for n in names) != fold, names  # the fp16 ring alone
    assert "decode_attn_reduce_kernel" in names[-1], names


# (ctx, group, n_q): shorter than the sinks, than sinks + window, at its edges, past a
# wrap of the ring's slots, and 1-4 query rows per KV head
FOLD_CASES = [(3, 4, 1), (100, 2, 2), (131, 1, 4), (133, 4, 1), (700, 2, 2), (5000, 1, 4),
              (70000, 4, 1)]


@pytest.mark.parametrize("case", FOLD_CASES, ids=lambda c: "ctx{}-G{}-L{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_q4_folded_decode_matches_reference_and_unfolded(case, dtype, monkeypatch):
    ctx, group, n_q = case
    q, cache = _q4(ctx, dtype=dtype, batch=2, group=group, n_q=n_q)
    view = cache.view()
    seen = []
    real = parts_plan.folds
    monkeypatch.setattr(parts_plan, "folds", lambda c: seen.append(real(c)) or seen[-1])
    got = attention(q, view).float()
    assert seen == [True], "the parts did not fold"
    atol, rel = ke.TOLERANCE[dtype]
    ke.assert_close(got, _reference(q, view), atol=atol, rel_rms=rel, what=f"{case} {dtype}")
    monkeypatch.setattr(parts_plan, "FOLD", False)
    ke.assert_close(got, attention(q, view).float(), atol=atol, rel_rms=rel,
                    what=f"{case} {dtype} vs unfolded")


def test_q4_fused_decode_replays_in_a_cuda_graph():
    """Captured once with device lengths in the parts' views; after more tokens are
    appended the replay (new device length, stale host length) equals eager decode."""
    q, cache = _q4(3000, capacity=4096)
    lens = torch.full((1,), cache.length, dtype=torch.int32, device="cuda")

    def graph_view():
        v = cache.view()
        return dataclasses.replace(v, parts=tuple(
            dataclasses.replace(p, view=dataclasses.replace(p.view, length_t=lens))
            for p in v.parts))

    view = graph_view()
    attention(q, view)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, view)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(70):  # past a 64-token body block and a wrap of the fp16 ring's slots
        k, v = (torch.randn(1, 8, 1, 128, generator=gen, device="cuda").half()
                for _ in range(2))
        cache.append(k, v)
    lens.fill_(cache.length)
    graph.replay()
    want = attention(q, cache.view())
    ke.assert_close(out.float(), want.float(), atol=2e-3, rel_rms=1e-3, what="graph replay")


def test_q4_body_runs_beside_the_ring_and_sees_what_came_before():
    """Under PDL the body is planned beside the fp16 ring and the two fold into one launch
    (`parts_plan.folds`): a graph that writes the query right before attention must still
    read each replay's new query in both parts, and the reduce must see both parts' splits."""
    from kvtax import pdl
    from kvtax.attention.launch_table import sm_count

    q, cache = _q4(70000)
    view = cache.view()
    assert pdl.enabled("attention", q, False)
    seen = []
    real_room = parts_plan.make_room

    def room(checked):  # the plan as make_room leaves it (the fold then edits the body's)
        checked = real_room(checked)
        seen.append([(a.cfg.kernel, a.cfg.pdl_beside, a.cfg.num_splits) for a in checked])
        return checked

    launched = []
    real_launch = launch._launch_swap_gluon

    def spy(a, part, slots, ring=None):  # the folded launch: as the fp16 part's, not early
        launched.append((a.cfg.pdl_launch, a.cfg.pdl_beside, ring is not None))
        return real_launch(a, part, slots, ring=ring)

    parts_plan.make_room, launch._launch_swap_gluon = room, spy
    try:
        attention(q, view)
    finally:
        parts_plan.make_room, launch._launch_swap_gluon = real_room, real_launch
    assert launched == [(False, False, True)], launched
    assert [c[:2] for c in seen[0]] == [("warp", False), ("swap", True)]
    (_, _, ring), (_, _, body) = seen[0]  # two ring splits per head, every program resident
    programs = q.shape[0] * view.parts[0].view.num_kv_heads
    assert ring == parts_plan.ROOM_SPLITS
    assert (ring + body) * programs <= 8 * sm_count(q.device)
    gen = torch.Generator(device="cuda").manual_seed(7)
    queries = [torch.randn(q.shape, generator=gen, device="cuda").half() * 4 for _ in range(8)]
    q_in = torch.empty_like(q)
    src = torch.empty_like(q)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_in.copy_(src * 1.0)  # a kernel whose output the attention kernels read
        out = attention(q_in, view)
    atol, rel = ke.TOLERANCE[torch.float16]
    wants = [_reference(x, view) for x in queries]
    for step in range(40):
        src.copy_(queries[step % len(queries)])
        graph.replay()
        ke.assert_close(out.float(), wants[step % len(queries)], atol=atol, rel_rms=rel,
                        what=f"replay {step}")
