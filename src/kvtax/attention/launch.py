"""The launches: checked arguments in, one fused kernel (plus the split-KV reduce) run.

`launch_attention` is what `triton_attention` and the torch.library op call: it checks
the call, takes the table's `LaunchConfig` (or the caller's), builds the launch-wide
constexprs and runs prefill.py, or a decode kernel then reduce.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from functools import lru_cache

import torch
import triton

from kvtax import pdl
from kvtax.attention.checks import check_kv_start, check_max_key, check_prior, check_query
from kvtax.attention.kernels.decode import decode_attn_split_kernel
from kvtax.attention.kernels.decode_swap import decode_swap_kernel
from kvtax.attention.kernels.decode_warp import decode_warp_kernel
from kvtax.attention.kernels.prefill import prefill_attn_fwd_kernel
from kvtax.attention.kernels.reduce import decode_attn_reduce_kernel
from kvtax.attention import parts_plan
from kvtax.attention.launch_table import LaunchConfig, launch_config
from kvtax.attention.support import (
    format_code, gluon_swap_kernel, gluon_swap_reason, half_width, interpreting,
    swap_reason, unsupported_reason, v_pairs, warp_reason,
)
from kvtax.attention.view import CacheView
from kvtax.errors import ShapeError
from kvtax.formats import AffineFormat, ChannelBlockFormat, FP8Format, KVFormat, rotate

# Test hook: fill split-KV partials (and triton_attention_lse's outputs) with NaN before
# each launch so unwritten ones show.
POISON_WORKSPACE = False
LOG2E = 1.4426950408889634


def launch_attention(
    q: torch.Tensor, view: CacheView, *, scale: float | None = None,
    softcap: float | None = None, lengths: torch.Tensor | None = None,
    kv_start: torch.Tensor | None = None, out: torch.Tensor | None = None,
    config: LaunchConfig | None = None, lse: torch.Tensor | None = None,
    min_distance: int = 0, min_key: int = 0,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None, max_key: int | None = None,
) -> torch.Tensor:
    """`triton_attention`'s launches. Besides its arguments (`out` may also be float32):
    lse: optional contiguous float32 `[B, H_q, L]`, filled with each row's log-sum-exp;
    min_distance / min_key: hide keys closer than that to the query, or before that
    position (`attention_lse`'s masks). Both off by default (the plain kernel variants).
    prior: `(out_p [B, H_q, L, D], lse_p [B, H_q, L])` contiguous float32, an earlier
    disjoint part's attention (`triton_attention_lse`'s pair) merged into this call's
    result (`merge_lse`'s sum, in the prefill kernel's epilogue; out and lse may be the
    same tensors). Prefill calls only (ShapeError on the decode path).
    max_key: hide keys at positions >= max_key, which must be a multiple of the launch's
    BLOCK_N (slots past it are never read, so the storage may end there); full caches
    (no ring, window or kv_start), prefill calls only (a staged prefill's chunk)."""
    n_q, group, lengths, kv_start, out = _checked_call(q, view, lengths, kv_start, out, lse,
                                                       min_distance, min_key)
    check_prior(prior, q)
    if n_q == 0 or q.shape[0] == 0:
        return out
    cfg = config or launch_config(q, view, lengths, softcap=bool(softcap),
                                  masked=kv_start is not None)
    qk_scale, cap_log2 = _score_scales(view, scale, softcap)
    args = _Args(q, view, cfg, lengths, kv_start, lse, out, min_distance, min_key,
                 qk_scale, cap_log2, bool(softcap))
    if cfg.path == "prefill":
        check_max_key(max_key, view, kv_start, block_n=cfg.block_n)
        if max_key is not None:
            args.common["HAS_MIN_DIST"] = True
        grid = (triton.cdiv(group * n_q, cfg.block_m), q.shape[0] * view.num_kv_heads)
        pri = (dict(Prior=prior[0], PriorLse=prior[1], HAS_PRIOR=True) if prior is not None
               else dict(Prior=out, PriorLse=args.lse["Lse"]))
        prefill_attn_fwd_kernel[grid](
            q, out, *args.cache, *args.scalars, *q.stride(), *out.stride()[:3], *args.strides,
            **args.masks, **args.lse, **pri, **args.common,
            max_key=2**31 - 1 if max_key is None else max_key,
        )
        return out
    if max_key is not None:
        raise ShapeError(f"max_key: {n_q} query rows take the decode path (prefill only)")
    if prior is not None:
        raise ShapeError(f"prior: {n_q} query rows take the decode path, which merges parts "
                         "in its reduce (launch_parts_decode)")
    _decode(args, explicit=config is not None)
    return out


def launch_parts_decode(
    parts: Sequence[tuple[torch.Tensor, CacheView, int, int]], out: torch.Tensor, *,
    scale: float | None = None, softcap: float | None = None,
    rotate_partials: Sequence[bool] = (),
) -> torch.Tensor:
    """Decode attention over disjoint key sets (a hybrid cache's parts) in one softmax:
    each part's split kernel writes its partials into its own split slots of one shared
    workspace, then ONE reduce merges every split of every part into `out` (no per-part
    output, no log-sum-exp round trip, no torch merge).

    parts: `(q_i, view_i, min_distance_i, min_key_i)`: q_i `[B, H_q, L, D]` (the same
    shape for every part; a part whose keys are stored rotated takes rotated queries) and
    its view with its masks (`launch_attention`'s); every part must take the decode path
    (`launch_config(...).path == "decode"`; ShapeError otherwise).
    out: contiguous `[B, H_q, L, D]` in q's dtype or float32.
    rotate_partials: per part, apply the Hadamard rotation to its partial outputs before
    the reduce (moves a part into the other parts' value domain: H is linear).
    Returns out. Device lengths: each view's `length_t`, as launch_attention reads them.
    """
    q0 = parts[0][0]
    checked = []
    for q, view, min_distance, min_key in parts:
        if q.shape != q0.shape:
            raise ShapeError(f"the parts' queries differ in shape: {tuple(q.shape)}")
        _, _, lengths, _, out = _checked_call(q, view, None, None, out, None, min_distance,
                                              min_key)
        cfg = launch_config(q, view, lengths, softcap=bool(softcap))
        if cfg.path != "decode":
            raise ShapeError(f"{q.shape[2]} query rows take the prefill kernel, not decode")
        qk_scale, cap_log2 = _score_scales(view, scale, softcap)
        checked.append(_Args(q, view, cfg, lengths, None, None, out, min_distance, min_key,
                             qk_scale, cap_log2, bool(softcap)))
    if q0.shape[2] == 0 or q0.shape[0] == 0:
        return out
    parts_plan.short_splits(checked)
    if not any(rotate_partials):
        checked = parts_plan.make_room(parts_plan.beside(checked))
    fold = parts_plan.folds(checked)
    part = decode_workspace(q0, parts[0][1].num_kv_heads,
                            sum(a.cfg.num_splits for a in checked))
    if fold:  # one launch: the fp16 part's splits, then the body's
        _launch_folded(*checked, part)
    else:
        base = 0
        for i, a in enumerate(checked):
            _decode_splits(a, part, explicit=False, split_base=base)
            if i < len(rotate_partials) and rotate_partials[i]:
                seg = part[0][:, base:base + a.cfg.num_splits]
                seg.copy_(rotate(seg))
            base += a.cfg.num_splits
    _reduce(part, out, q0, checked[0].common["G"], dict(Lse=out, HAS_LSE=False))
    return out


def _launch_folded(ring: _Args, body: _Args, part: tuple) -> None:
    """q4's two parts in one launch (`parts_plan.folds`): the swap kernel over the body,
    the fp16 part's splits its first programs, at split slots `[0, ring's splits)`."""
    # launched as the fp16 part was (normally: `beside`); launched early, the body's
    # 8-per-SM grid landed beside the kernel before it and the whole model's 128k step
    # read 7.95 ms/token against 7.25 unfolded (H100, 2026-12-06, docs/KERNELS.md)
    body.cfg = dataclasses.replace(body.cfg, pdl_beside=False, pdl_launch=ring.cfg.pdl_launch)
    # the Gluon kernel where it serves the body (as `folds` requires), else its twin
    fn = _launch_swap_gluon if gluon_swap_reason(body.q, body.view) is None else \
        _launch_swap_triton
    fn(body, part, dict(split_base=ring.cfg.num_splits, splits_total=part[1].shape[1]),
       ring=ring)


def _checked_call(q, view, lengths, kv_start, out, lse,  # noqa: ANN001, ANN202
                  min_distance, min_key):  # noqa: ANN001
    """What every launch checks first: the kernels serve (q, view), the query's shape, the
    buffers (`_checked_buffers`) and the masks' range; (n_q, group, lengths, kv_start, out)."""
    reason = unsupported_reason(q, view, allow_cpu=interpreting())
    if reason is not None:
        raise ShapeError(f"triton_attention cannot run this call: {reason}")
    n_q, group = check_query(q, view)
    lengths, kv_start, out = _checked_buffers(q, view, lengths, kv_start, out, lse)
    if not 0 <= min_distance < 2**31 or not 0 <= min_key < 2**31:
        raise ShapeError(f"min_distance {min_distance}, min_key {min_key} must be in [0, 2^31)")
    return n_q, group, lengths, kv_start, out


def _score_scales(view: CacheView, scale: float | None, softcap: float | None):  # noqa: ANN202
    """(qk_scale, cap_log2): base-2 score scaling, or scale / softcap before the tanh."""
    scale = 1.0 / math.sqrt(view.head_dim) if scale is None else float(scale)
    if softcap:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


def _checked_buffers(q, view, lengths, kv_start, out, lse):  # noqa: ANN001, ANN202
    """(lengths, kv_start, out) checked and ready for the kernels: lengths int32 `[B]` on
    q's device (default `view.length_t`), kv_start int32, out allocated when None."""
    b, h_q, n_q, d = q.shape
    if lengths is None:
        lengths = getattr(view, "length_t", None)
    if kv_start is not None:
        kv_start = check_kv_start(kv_start, view).to(torch.int32)
    if lengths is not None:
        if lengths.dtype != torch.int32 or lengths.shape != (b,) or lengths.device != q.device:
            raise ShapeError(
                f"lengths must be int32 [{b}] on {q.device}, got {lengths.dtype} "
                f"{tuple(lengths.shape)} on {lengths.device}"
            )
        lengths = lengths.contiguous()
    if out is None:
        out = torch.empty((b, h_q, n_q, d), dtype=q.dtype, device=q.device)
    elif (out.shape != q.shape or out.dtype not in (q.dtype, torch.float32)
          or not out.is_contiguous()):
        raise ShapeError(f"out must be contiguous {tuple(q.shape)} {q.dtype} (or float32)")
    if lse is not None and (lse.shape != (b, h_q, n_q) or lse.dtype != torch.float32
                            or not lse.is_contiguous() or lse.device != q.device):
        raise ShapeError(f"lse must be contiguous float32 {(b, h_q, n_q)} on {q.device}")
    return lengths, kv_start, out


class _Args:
    """One call's kernel arguments, shared by the launch paths: the cache pointers, the
    run-time scalars and strides, and the launch-wide constexprs (`common`)."""

    def __init__(self, q, view, cfg, lengths, kv_start, lse, out, min_distance, min_key,
                 qk_scale, cap_log2, softcap) -> None:  # noqa: ANN001
        d = view.head_dim
        self.q, self.view, self.cfg, self.lengths, self.out = q, view, cfg, lengths, out
        self.qk_scale, self.cap_log2, self.softcap = qk_scale, cap_log2, softcap
        self.k_fmt, k_gs = format_code(view.spec.key)  # type: ignore[misc]
        self.v_fmt, v_gs = format_code(view.spec.value)  # type: ignore[misc]
        kc, ks, kb = storage_parts(view.k)
        vc, vs, vb = storage_parts(view.v)
        self.common = dict(
            G=q.shape[1] // view.num_kv_heads, HEAD_DIM=d, HALF=half_width(d),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            K_FMT=self.k_fmt, K_GS=max(k_gs, 1), V_FMT=self.v_fmt, V_GS=max(v_gs, 1),
            IS_RING=view.ring > 0, HAS_WINDOW=view.window is not None, SOFTCAP=softcap,
            HAS_LENS=lengths is not None, IEEE=_ieee_dots(q.dtype),
            FOLD_K=cfg.fold and _fold_pays(view.spec.key, d, cfg.block_n),
            FOLD_V=cfg.fold and _fold_pays(view.spec.value, d, cfg.block_n),
            HAS_KV_START=kv_start is not None, HAS_MIN_DIST=bool(min_distance or min_key),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        # hybrid-cache parts (triton_attention_lse): extra masks, per-row log-sum-exp
        self.masks = dict(min_dist=min_distance, min_key=min_key)
        self.lse = dict(Lse=lse if lse is not None else out, HAS_LSE=lse is not None)
        self.scalars = (
            view.length, q.shape[2], view.num_kv_heads, view.sinks, max(view.ring, 1),
            view.window if view.window is not None else 0, qk_scale, cap_log2,
        )
        self.cache = (
            kc, ks, kb, vc, vs, vb, lengths if lengths is not None else kc,
            kv_start if kv_start is not None else kc,
        )
        self.strides = (*kc.stride()[:3], *ks.stride()[:3], *vc.stride()[:3], *vs.stride()[:3])


def _decode(a: _Args, explicit: bool) -> None:
    """Split-KV decode: the config's decode kernel writes partials, reduce.py merges them
    (`explicit`: the caller chose the config, so a "swap" config is checked here)."""
    part = decode_workspace(a.q, a.view.num_kv_heads, a.cfg.num_splits)
    _decode_splits(a, part, explicit)
    _reduce(part, a.out, a.q, a.common["G"], a.lse)


def decode_workspace(q: torch.Tensor, n_kv_heads: int, splits: int) -> tuple:
    """Split-KV partials of `splits` splits per (batch, KV head): PartO `[B * H_kv, splits,
    R, D]`, PartM and PartL `[B * H_kv, splits, R]` float32 (R = G * L query rows)."""
    b, h_q, n_q, d = q.shape
    rows = h_q // n_kv_heads * n_q
    return (workspace((b * n_kv_heads, splits, rows, d), q.device),
            workspace((b * n_kv_heads, splits, rows), q.device),
            workspace((b * n_kv_heads, splits, rows), q.device))


def _decode_splits(a: _Args, part: tuple, explicit: bool, split_base: int = 0) -> None:
    """The config's decode kernel: its splits' partials into `part`'s split slots
    `[split_base, split_base + num_splits)` (the rest belong to other launches)."""
    q, view, cfg = a.q, a.view, a.cfg
    b, h_kv = q.shape[0], view.num_kv_heads
    rows, splits = a.common["G"] * q.shape[2], cfg.num_splits
    slots = dict(split_base=split_base, splits_total=part[1].shape[1])
    grid = (b * h_kv, splits)
    tail = (*a.cache, a.scalars[0], q.shape[2], splits, *a.scalars[2:], *q.stride(), *a.strides)
    if cfg.kernel == "swap":
        _swap(a, part, explicit, slots)
    elif cfg.kernel == "warp":
        reason = warp_reason(view)
        if isinstance(view.spec.key, ChannelBlockFormat) and cfg.block_n > 64:
            reason = f"{view.spec.key.name} keys need tiles inside one 64-slot block"
        if reason is not None or cfg.block_m < rows:
            raise ShapeError(f"decode_warp kernel cannot run this call: {reason or 'rows'}")
        decode_warp_kernel[grid](
            q, *part, *tail, **a.masks, **slots, HAS_MIN_DIST=a.common["HAS_MIN_DIST"],
            **_warp_args(a), **pdl_options("attention", q, cfg),
        )
    else:
        decode_attn_split_kernel[grid](
            q, *part, *tail, **a.masks, **slots, **a.common,
            **pdl_options("attention", q, cfg),
        )


def _reduce(part: tuple, out: torch.Tensor, q: torch.Tensor, group: int, lse: dict) -> None:
    """reduce.py over every split of `part` into out (`lse`: _Args.lse's keywords)."""
    bh, splits, rows, d = part[0].shape
    splits_pad = triton.next_power_of_2(splits)
    d_block = min(32, triton.next_power_of_2(d))
    decode_attn_reduce_kernel[(bh, rows, triton.cdiv(d, d_block))](
        *part, out, q.shape[2], splits, bh // q.shape[0], *out.stride()[:3], **lse,
        G=group, HEAD_DIM=d, D_BLOCK=d_block,
        # all splits in one shot up to 256 (a [256, 32] float32 tile over 4 warps)
        SPLITS_PAD=splits_pad, SPLIT_BLOCK=splits_pad if splits_pad <= 256 else 64,
        num_warps=4, **pdl_options("reduce", q),
    )


def _swap(a: _Args, part: tuple, explicit: bool, slots: dict) -> None:
    """Kernel "swap": the Gluon kernel where it serves the call, else its Triton twin
    (decode_swap.py: the interpreter, soft-capping, the shapes only it takes).
    launch_config picks "swap" only where the Gluon kernel serves the call (checked
    there, once per call); a caller's explicit config is checked here."""
    q, view = a.q, a.view
    if explicit:
        reason = swap_reason(q, view)
        if reason is None and a.common["HAS_KV_START"]:
            reason = "left padding is decode_warp.py's"
        if reason is not None:
            raise ShapeError(f"decode_swap kernel cannot run this call: {reason}")
    if not explicit or (not a.softcap and gluon_swap_reason(q, view) is None):
        _launch_swap_gluon(a, part, slots)
    else:
        _launch_swap_triton(a, part, slots)


def _launch_swap_triton(a: _Args, part: tuple, slots: dict, ring: _Args | None = None) -> None:
    """decode_swap.py (the Triton twin: any `swap_reason` case, soft-capping too); `ring`
    as `_launch_swap_gluon`'s."""
    q, view, cfg = a.q, a.view, a.cfg
    d, b, h_kv = view.head_dim, q.shape[0], view.num_kv_heads
    # int4-c64 / int4w-c64: block vectors
    k_ng = 1 if a.k_fmt in (4, 7) else d // view.spec.key.group_size
    fold = _fold_args(ring, a.cache[0])
    decode_swap_kernel[(b * h_kv, cfg.num_splits + fold["f_splits"])](
        q, *part, *a.cache[:7], view.length, q.shape[2], cfg.num_splits, h_kv,
        a.qk_scale, a.cap_log2, *q.stride(), *a.strides, **a.masks, **slots, **fold,
        G=q.shape[1] // h_kv, HEAD_DIM=d, K_FMT=a.k_fmt, K_NG=k_ng,
        V_FMT=a.v_fmt, V_NG=d // view.spec.value.group_size, SOFTCAP=a.softcap,
        HAS_LENS=a.lengths is not None, ASM=not interpreting(), FOLD=ring is not None,
        num_warps=1,
        num_stages=cfg.num_stages, **pdl_options("attention", q, cfg),
    )


def _launch_swap_gluon(a: _Args, part: tuple, slots: dict, ring: _Args | None = None) -> None:
    """decode_swap_gluon.py: scales and biases as 32-bit words (one slot's lo / hi pair;
    `swap_reason` checked their alignment), V codes as uint16 pairs; int4-c64 keys' block
    metadata as stored (`[slots / 64, D]` per head, model dtype). `ring` (`parts_plan.folds`):
    a hybrid cache's fp16 part, read by this launch's first programs at split slots
    `[0, ring.cfg.num_splits)`."""
    import triton.experimental.gluon.language as gl

    q, view, cfg, lengths = a.q, a.view, a.cfg, a.lengths
    b, h_kv = q.shape[0], view.num_kv_heads
    kc, ks, kb = storage_parts(view.k)
    vc, vs, vb = storage_parts(view.v)
    words = [t.view(torch.int32)[..., 0] for t in (ks, kb, vs, vb)]
    kc64 = a.k_fmt in (4, 7)  # int4w-c64 (7): int4-c64's block vectors plus fifth bits
    if kc64:
        words[:2] = ks, kb
    vc16 = vc.view(torch.int16)
    fold = _fold_args(ring, kc)
    gluon_swap_kernel()[(b * h_kv, cfg.num_splits + fold["f_splits"])](
        q, *part, kc, vc16, *words,
        lengths if lengths is not None else kc, view.length, q.shape[2], cfg.num_splits, h_kv,
        a.qk_scale, *q.stride(), *kc.stride()[:3], *words[0].stride()[:2],
        *vc16.stride()[:3], *words[2].stride()[:2], **a.masks, **slots, **fold,
        G=q.shape[1] // h_kv, D=view.head_dim, STAGES=cfg.num_stages,
        MDT=gl.float16 if q.dtype == torch.float16 else gl.bfloat16,
        INT4=view.spec.key.n_bits == 4, HAS_LENS=lengths is not None, KC64=kc64,
        HAS_MIN_DIST=a.common["HAS_MIN_DIST"], KW=a.k_fmt == 7, FOLD=ring is not None,
        num_warps=1, **pdl_options("attention", q, cfg), **_reg_cap(cfg),
    )


def _fold_args(ring: _Args | None, kc: torch.Tensor) -> dict:
    """The swap kernels' FOLD arguments: a hybrid cache's fp16 part (`ring`: its K / V,
    sinks, ring and window, its splits first at split slot 0), or none (kc stands in)."""
    names = ("f_splits", "f_base", "sinks", "ring", "window", "s_fk_b", "s_fk_h", "s_fk_t",
             "s_fv_b", "s_fv_h", "s_fv_t")
    if ring is None:
        return dict(fk=kc, fv=kc, **dict.fromkeys(names, 0))
    fk, fv = ring.view.k.codes, ring.view.v.codes
    return dict(fk=fk, fv=fv, **dict(zip(names, (
        ring.cfg.num_splits, 0, ring.view.sinks, ring.view.ring, ring.view.window,
        *fk.stride()[:3], *fv.stride()[:3]))))


def _reg_cap(cfg) -> dict:
    """ptxas's register cap for a launch whose config sets one (`max_registers`)."""
    return {} if cfg.max_registers is None else {"maxnreg": cfg.max_registers}


# the launch-wide constexprs decode_warp.py takes from `common`
_ONE_WARP_KEYS = ("G", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "K_FMT", "V_FMT", "IS_RING",
                  "HAS_WINDOW", "SOFTCAP", "HAS_LENS", "IEEE", "HAS_KV_START", "num_warps",
                  "num_stages")


def _warp_args(a: _Args) -> dict:
    """decode_warp.py's constexprs (its operand dtypes and groups per row)."""
    import triton.language as tl

    view, ieee = a.view, a.common["IEEE"]
    tl_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

    def side(fmt: KVFormat) -> tuple[int, object]:
        code, gs = format_code(fmt)  # type: ignore[misc]
        ng = view.head_dim // gs if code in (1, 2) else 1
        if ieee:
            dt = tl.float32
        elif code == 0:  # stored rows go to the dots as they are
            dt = tl_dtype[view.k.codes.dtype if fmt is view.spec.key else view.v.codes.dtype]
        else:  # centered codes and fp8 values are exact in fp16
            dt = tl.float16
        return ng, dt

    k_ng, k_dt = side(view.spec.key)
    v_ng, v_dt = side(view.spec.value)
    args = {k: a.common[k] for k in _ONE_WARP_KEYS}
    args.update(K_NG=k_ng, V_NG=v_ng, K_DT=k_dt, V_DT=v_dt, ASM=not interpreting(),
                V_PAIRS=v_pairs(view))
    return args


def pdl_options(kind: str, q: torch.Tensor, cfg: LaunchConfig | None = None) -> dict:
    """Launch keywords for programmatic dependent launch (kvtax.pdl): the decode kernels'
    PDL / PDL_LATE constexprs and the reduce's PDL, and launch_pdl; {} when off. A decode
    kernel's config narrows them (`pdl_launch`, `pdl_late`; see swap_decode_config)."""
    opts = pdl.launch_options(kind, q, interpreting())
    if opts and cfg is not None:
        opts["launch_pdl"] = opts["launch_pdl"] and cfg.pdl_launch
        opts["PDL_LATE"] = cfg.pdl_late
        if cfg.pdl_beside:
            opts["PDL_BESIDE"] = True
    return opts


def _fold_pays(fmt: KVFormat, head_dim: int, block_n: int) -> bool:
    """Move scales off the elements (decode) for fp8 and for int4 / int3 whose half-rows
    each lie in one scale group; int8 measured faster dequantizing per element
    (docs/KERNELS.md). int4-c64 / int3-c64 keys fold into the queries where a tile lies in
    one 64-slot block. (3-bit takes int4's rule: the fold saves the same per-element
    multiply-add after the same unpack; not yet measured on a GPU.)"""
    if isinstance(fmt, FP8Format):
        return True
    if isinstance(fmt, ChannelBlockFormat):
        return block_n <= fmt.block
    half = head_dim // 2
    return (isinstance(fmt, AffineFormat) and fmt.n_bits in (3, 4)
            and fmt.group_size >= half and half_width(head_dim) == half)


def _ieee_dots(dtype: torch.dtype) -> bool:
    """float32 dots for fp32 models, and for bf16 under the interpreter, whose bf16
    tl.dot is broken (Triton 3.9 returns garbage); compiled bf16 keeps bf16 dots."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def storage_parts(qt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """codes, scales, biases; absent parts alias codes (the kernels never read them).
    fp8-pt (fp8 codes, no scales) reads fp8's kernel path with a stride-0 scale of 1.0."""
    codes = qt.codes
    scales = qt.scales
    if codes.dtype == torch.float8_e4m3fn:
        if scales is None:
            scales = _unit_scale(codes.device).expand(*codes.shape[:-1], 1)
        codes = codes.view(torch.uint8)
    scales = scales if scales is not None else codes
    biases = qt.biases if qt.biases is not None else scales
    return codes, scales, biases


@lru_cache(maxsize=None)
def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 per device, kept (a captured decode graph keeps pointing at it)."""
    return torch.ones((), dtype=torch.float32, device=device)


def workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An uninitialized float32 buffer (NaN-filled under the POISON_WORKSPACE test hook)."""
    if POISON_WORKSPACE:
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)
    return torch.empty(shape, dtype=torch.float32, device=device)
