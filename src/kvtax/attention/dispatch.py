"""`attention(q, view)`: fused Triton kernels on CUDA, the blockwise torch path elsewhere.

A CUDA call the kernels cannot serve (an unsupported head_dim, say) falls back to
`blockwise.attention_blockwise` (the "reference" impl) and warns once per reason, so a
slow path is never taken silently.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from kvtax.attention.blockwise import attention_blockwise
from kvtax.attention.checks import rotate_query, unrotate_output
from kvtax.attention.hybrid import HybridPart, HybridView
from kvtax.attention.lse import attention_lse, merge_lse
from kvtax.attention.view import CacheView
from kvtax.errors import FormatError
from kvtax.formats import rotate
from kvtax.formats.spec import centering_conflict

Impl = Literal["auto", "reference", "triton"]
_warned: set[str] = set()


def attention(
    q: torch.Tensor,
    view: CacheView | HybridView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    impl: Impl = "auto",
    kv_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the last `L` positions' queries over a (quantized) cache view.

    q:     `[B, H_q, L, D]` in fp16/bf16/fp32; H_q a multiple of the cache's KV heads.
    view:  `cache.view()` of the layer's cache, already holding these L tokens' K/V; a
           HybridCache's HybridView decodes (L <= 16) in one softmax over all its parts
           (`hybrid_decode`: a split kernel per part, one reduce), prefills by chaining its
           parts' prefill kernels (`hybrid_prefill`), and otherwise (CPU, shapes the
           kernels cannot take) is the LSE merge of `part_attention` over its parts.
           A long prefill chunk over a quantized full cache runs staged
           (`staged_attention`: fp16 attention over bounded dequantized chunks).
    Returns `[B, H_q, L, D]` in q.dtype. Causal masking is bottom-right aligned; the
    view's window and sinks apply. `impl="triton"` raises where the kernels can't run.
    kv_start: optional int `[B]`, each row's first valid key position (left padding).

    Example:
        cache.append(k, v)
        out = attention(q, cache.view(), softcap=None)
    """
    if isinstance(view, HybridView):
        if not causal or kv_start is not None:
            raise ValueError("hybrid-cache attention is causal and takes no kv_start")
        if impl != "reference" and hybrid_decode_reason(q, view) is None:
            return hybrid_decode(q, view, scale=scale, softcap=softcap)
        if impl != "reference" and hybrid_prefill_reason(q, view) is None:
            return hybrid_prefill(q, view, scale=scale, softcap=softcap)
        parts = [part_attention(q, p, scale=scale, softcap=softcap, impl=impl)
                 for p in view.parts]
        return merge_lse(parts)[0].to(q.dtype)
    refuse_centered_softcap(view, softcap)
    ref = dict(scale=scale, softcap=softcap, causal=causal, kv_start=kv_start)
    if impl == "reference":
        return attention_blockwise(q, view, **ref)
    reason = kernel_unavailable(q, view, causal, kv_start)
    if reason is None and _staged(q, view, kv_start):
        return staged_attention(q, view, scale=scale, softcap=softcap)
    if reason is None:
        from kvtax.attention.triton_api import triton_attention

        pad = {} if kv_start is None else {"kv_start": kv_start}
        if view.length_t is not None:  # CUDA-graph decode: the kernels read the length
            pad["lengths"] = view.length_t
        # The kernels read the stored domain; a Hadamard-rotated spec is handled here.
        out = triton_attention(rotate_query(q, view), view, scale=scale, softcap=softcap, **pad)
        return unrotate_output(out, view)
    if impl == "triton":
        raise RuntimeError(f"Triton attention cannot run this call: {reason}")
    warn_reference_once(q, reason, "attention", stacklevel=3)
    return attention_blockwise(q, view, **ref)


def _staged(q: torch.Tensor, view: CacheView, kv_start: torch.Tensor | None) -> bool:
    """True when this fused-kernel call is a prefill that `staged.staged_launch` serves
    (not while torch.compile traces: there the custom op, one fused launch, stays)."""
    from kvtax.attention.launch_table import decode_rows
    from kvtax.attention.staged import staged_reason

    if torch.compiler.is_compiling() or decode_rows(q, view):
        return False
    return staged_reason(q, view, kv_start) is None


@torch.compiler.disable  # launched Triton kernels and host loops: no tracing (hybrid_decode)
def staged_attention(
    q: torch.Tensor, view: CacheView, *, scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`attention(q, view)` of a long prefill chunk over a quantized full cache, staged
    (kvtax.attention.staged): `[B, H_q, L, D]` in q.dtype."""
    from kvtax.attention.staged import staged_launch

    qs = rotate_query(q, view)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return unrotate_output(staged_launch(qs, view, out=out, scale=scale, softcap=softcap), view)


def hybrid_decode_reason(q: torch.Tensor, view: HybridView) -> str | None:
    """None when `hybrid_decode` serves `attention(q, view)`: every part on the fused
    kernels (CUDA, or forced under the interpreter) and decode rows (the decode path of
    `launch_table.launch_config`); else why not (the per-part path runs instead)."""
    from kvtax.attention.launch_table import decode_rows

    for p in view.parts:
        reason = kernel_unavailable(q, p.view, True)
        if reason is not None:
            return reason
        if not decode_rows(q, p.view):
            return f"{q.shape[2]} query rows take the prefill kernel"
    return None


# torch.compile must not trace this: inductor would re-emit the launched Triton kernels and
# cannot (their inline PTX broke its code generation on an H200, 2026-12-03). The graph
# break costs nothing inside a CUDA graph, which replays the launches without Python.
@torch.compiler.disable
def hybrid_decode(
    q: torch.Tensor, view: HybridView, *, scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention over a hybrid cache in 3 launches: each part's split kernel, its
    masks applied in-kernel, writes (acc, m, l) into its split slots of one shared
    workspace, and one reduce over every split writes `[B, H_q, L, D]` in q.dtype
    (`launch.launch_parts_decode`). q `[B, H_q, L]`, L <= 16 (`hybrid_decode_reason`).

    Rotated specs cost launches only where present: rotated keys take `q H` (once for
    every such part); where some part stores values rotated, the others' partials are
    rotated into that domain before the reduce (H is linear) and the float32 result is
    rotated back (H is its own inverse)."""
    from kvtax.attention.launch import launch_parts_decode

    for p in view.parts:
        refuse_centered_softcap(p.view, softcap)
    q_rot = rotate(q) if any(p.view.spec.rotate_keys for p in view.parts) else None
    parts = [(q_rot if p.view.spec.rotate_keys else q, p.view, p.min_distance, p.min_key)
             for p in view.parts]
    rotated = [p.view.spec.rotate_values for p in view.parts]
    if not any(rotated):  # the reduce writes the final output directly
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return launch_parts_decode(parts, out, scale=scale, softcap=softcap)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    launch_parts_decode(parts, out, scale=scale, softcap=softcap,
                        rotate_partials=[not r for r in rotated])
    return rotate(out).to(q.dtype)


def hybrid_prefill_reason(q: torch.Tensor, view: HybridView) -> str | None:
    """None when `hybrid_prefill` serves `attention(q, view)`: every part on the fused
    kernels' prefill path, no part storing rotated values; else why not."""
    from kvtax.attention.launch_table import decode_rows

    for p in view.parts:
        reason = kernel_unavailable(q, p.view, True)
        if reason is not None:
            return reason
        if decode_rows(q, p.view):
            return f"{q.shape[2]} query rows take the decode kernels"
        if p.view.spec.rotate_values:
            return f"part {p.view.spec.name} stores rotated values"
    return None


@torch.compiler.disable  # as hybrid_decode: launched Triton kernels, no tracing
def hybrid_prefill(
    q: torch.Tensor, view: HybridView, *, scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Prefill attention over a hybrid cache as a chain of its parts' prefill kernels: each
    but the last writes float32 rows and their log-sum-exp, and the next merges them in
    its epilogue (`launch_attention(prior=...)`), the last writing `[B, H_q, L, D]` in
    q.dtype. Exactly `merge_lse` over `part_attention`, without the torch merge (0.18-0.35
    ms a 2048-row chunk of q4 on an H200). The part with the fewest slots goes last: the
    epilogue's registers cost the quantized body's prefill kernel, at its 255-register
    limit, ~10% at 128k (H200, 2026-12-03), and a ring read through a window (q4's fp16
    part) costs next to nothing. A part `staged.staged_reason` accepts (the quantized body,
    long chunks) runs staged: fp16 attention over its dequantized chunks, chained the
    same way. `hybrid_prefill_reason` must be None."""
    from kvtax.attention.launch import launch_attention, workspace
    from kvtax.attention.staged import staged_launch, staged_reason

    for p in view.parts:
        refuse_centered_softcap(p.view, softcap)
    q_rot = rotate(q) if any(p.view.spec.rotate_keys for p in view.parts) else None
    prior = None
    chain = sorted(view.parts, key=lambda p: -_slots_read(p.view))  # stable sort
    for i, p in enumerate(chain):
        qp = q_rot if p.view.spec.rotate_keys else q
        kw = dict(scale=scale, softcap=softcap, min_distance=p.min_distance,
                  min_key=p.min_key, prior=prior)
        run = staged_launch if staged_reason(qp, p.view) is None else launch_attention
        if i == len(chain) - 1:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            return run(qp, p.view, out=out, **kw)
        o, lse = (workspace(tuple(q.shape), q.device), workspace(tuple(q.shape[:3]), q.device)
                  ) if prior is None else prior  # a middle part updates the pair in place
        run(qp, p.view, out=o, lse=lse, **kw)
        prior = (o, lse)
    raise ValueError("a hybrid view has at least one part")


def _slots_read(view: CacheView) -> int:
    """Slots a query reads at most: a window's (and the sinks) or the whole cache."""
    return view.num_slots if view.window is None else min(view.num_slots,
                                                          view.window + view.sinks)


def part_attention(
    q: torch.Tensor, part: HybridPart, *, scale: float | None = None,
    softcap: float | None = None, impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out [B, H_q, L, D], lse [B, H_q, L])` float32 of `q` over one hybrid part, its
    masks applied: the fused kernels where they serve the part's view (CUDA), else
    `attention_lse` (the torch reference)."""
    refuse_centered_softcap(part.view, softcap)
    kw = dict(scale=scale, softcap=softcap, min_distance=part.min_distance,
              min_key=part.min_key)
    if impl == "reference":
        return attention_lse(q, part.view, **kw)
    reason = kernel_unavailable(q, part.view, True)
    if reason is None:
        from kvtax.attention.triton_api import triton_attention_lse

        return triton_attention_lse(q, part.view, **kw)
    if impl == "triton":
        raise RuntimeError(f"Triton attention cannot run this call: {reason}")
    warn_reference_once(q, reason, "hybrid-cache attention", stacklevel=4)
    return attention_lse(q, part.view, **kw)


def refuse_centered_softcap(view: CacheView, softcap: float | None) -> None:
    """FormatError where the view's keys are centered and the call soft-caps (refuse,
    don't drift: kvtax.formats.spec.centering_conflict)."""
    why = centering_conflict(view.spec, softcap)
    if why is not None:
        raise FormatError(why)


def warn_reference_once(q: torch.Tensor, reason: str, what: str, stacklevel: int = 2) -> None:
    """Say once per reason that CUDA `what` runs the torch reference (slower) and why."""
    if q.is_cuda and reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"kvtax: using the torch reference for {what} on CUDA ({reason}); "
            "it is correct but slower than the fused kernels",
            stacklevel=stacklevel,
        )


def uses_kernels(
    q: torch.Tensor, view: CacheView, *, causal: bool = True, kv_start: torch.Tensor | None = None
) -> bool:
    """True when `attention(q, view, ...)` would run the fused kernels, not the reference.

    Callers that hand the kernels a device-side length (`view.length_t`, which the reference
    ignores) check this first.
    """
    return kernel_unavailable(q, view, causal, kv_start) is None


def kernel_unavailable(
    q: torch.Tensor, view: CacheView, causal: bool, kv_start: torch.Tensor | None = None
) -> str | None:
    """None when the fused kernels can serve this call, else why not."""
    if not q.is_cuda:
        return "tensors are not on a CUDA device"
    if not causal:
        return "the kernels implement causal attention only"
    try:
        from kvtax.attention import triton_api
    except ImportError as exc:  # triton missing or broken
        return f"Triton kernels unavailable ({exc})"
    return triton_api.unsupported_reason(q, view)
