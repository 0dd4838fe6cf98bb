"""How a hybrid cache's parts share the GPU in one fused decode call
(`launch.launch_parts_decode`): how many splits each part's kernel takes, and whether the
body's kernel runs beside the fp16 part's under programmatic dependent launch.

Each function takes the parts' per-call argument objects (`launch._Args`: `q`, `view`,
`lengths`, `cfg`) in launch order and replaces their `cfg` (a LaunchConfig) in place.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import triton

from kvtax import pdl
from kvtax.attention.launch_table import max_slots, sm_count
from kvtax.attention.support import gluon_swap_reason, interpreting


def make_room(checked: list[Any]) -> list[Any]:
    """Under `beside`, where the body (the last part) is a one-warp kernel sized to fill
    every SM at 8 programs (`LaunchConfig.per_sm`) and the parts before it would not fit
    beside it: those parts take at most ROOM_SPLITS splits per (batch, KV head) and the
    body gives up as many programs, so every program of both is resident from the start.

    Why (register arithmetic; the timings agree): an fp16-part program (decode_warp, 255
    registers) leaves room for one body program (~208) on its scheduler, not two; with every
    SM full, each one pushes a body program past its first wave, ending the body one fp16
    program later. On an H100 at 128k (attention.py, 2026-12-05) q4 took 0.070 ms with the
    part's 5 one-tile splits per head (`short_splits`), 0.073 with those and 5 body splits
    given up, 0.074 with one split per head and none given up, 0.067 with one split per
    head and one given up (int4 0.060); the body first and the part beside it after read
    0.077. At 12 body programs per SM (168 registers) one part program displaces two and
    the same change read 0.067 against 0.065: left as it was.

    Where the parts fold into one launch (`folds`), the part's programs are the body
    kernel's, and these counts still keep every program resident from the start.

    Why two splits, not one: one program per head walks the part's ~5 tiles alone, and
    where the body's programs are short that walk ends the call. H100, q4 (sweep of 1, 2,
    3, 5 part splits x 0-4 body splits given up, `benchmarks/fp16_part_plans.py`,
    2026-12-06): 16k 0.0220 → 0.0199 ms, 32k and 128k unchanged (0.0266 / 0.0669 against
    0.0267 / 0.0671); three or five splits gained nothing more and lost up to 2% at 128k."""
    if len(checked) < 2 or not checked[-1].cfg.pdl_beside:
        return checked
    body, small = checked[-1], checked[:-1]
    if body.cfg.per_sm != ROOM_PER_SM:
        return checked
    programs = body.q.shape[0] * body.view.num_kv_heads

    def over() -> int:
        shown = sum(a.cfg.num_splits * a.q.shape[0] * a.view.num_kv_heads for a in small)
        return (body.cfg.num_splits * programs + shown
                - body.cfg.per_sm * sm_count(body.q.device))

    if over() <= 0:
        return checked
    for a in small:
        a.cfg = dataclasses.replace(a.cfg, num_splits=min(a.cfg.num_splits, ROOM_SPLITS))
    give = -(-max(over(), 0) // programs)
    body.cfg = dataclasses.replace(body.cfg, num_splits=max(1, body.cfg.num_splits - give))
    return checked


ROOM_PER_SM = 8  # the body's programs per SM where `make_room` applies (measured there)
ROOM_SPLITS = 2  # splits per (batch, KV head) `make_room` leaves each smaller part


SHORT_PART_TILES = 64  # a part of at most this many tiles is read one tile per split


def _read_tiles(a: Any) -> int:
    """Tiles a decode over this part reads: a ring through a window reads only the sinks
    and the window's slots (common.py's `window_runs`; +2 tiles for their edges)."""
    v, n = a.view, max(max_slots(a.view, a.lengths), 1)
    if v.ring and v.window is not None:
        n = min(n, v.sinks + v.window + a.q.shape[2] + 2 * a.cfg.block_n)
    return triton.cdiv(n, a.cfg.block_n)


def short_splits(checked: list[Any]) -> None:
    """One tile per split for every part but the largest, where it reads at most
    SHORT_PART_TILES tiles: a hybrid cache's fp16 sinks + recent window read by few
    programs per head is a chain of dependent tile loads in one warp; one tile per
    program is one load's latency."""
    if len(checked) < 2:
        return
    tiles = [_read_tiles(a) for a in checked]
    largest = max(range(len(checked)), key=tiles.__getitem__)
    for i, a in enumerate(checked):
        if i != largest and tiles[i] <= SHORT_PART_TILES and a.cfg.num_splits < tiles[i]:
            a.cfg = dataclasses.replace(a.cfg, num_splits=tiles[i])


def beside(checked: list[Any]) -> list[Any]:
    """Under PDL, where the parts after the first all take kernel "swap" (q4: the fp16
    sinks + recent window first, then the body): the first part launches normally and
    lets the next launch first thing, and each later part runs beside the one before it
    (`common.pdl_enter`'s BESIDE), so the small part costs no launch boundary of its own.
    H200, 128k, q4: 0.0562 ms against 0.0589 in order (docs/BENCHMARKS.md)."""
    if len(checked) < 2 or not pdl.enabled("attention", checked[0].q, interpreting()):
        return checked
    if any(a.cfg.kernel != "swap" for a in checked[1:]):
        return checked
    for i, a in enumerate(checked):
        late = a.cfg.pdl_late if i == len(checked) - 1 else False  # the next runs beside
        a.cfg = (dataclasses.replace(a.cfg, pdl_launch=False, pdl_late=False) if i == 0 else
                 dataclasses.replace(a.cfg, pdl_launch=True, pdl_late=late, pdl_beside=True))
    return checked


# `folds` may answer yes; environment KVTAX_FOLD=0 keeps the parts' launches apart (as
# kvtax.pdl's KVTAX_PDL: for side-by-side timings; benchmarks/fp16_part_plans.py sets it)
FOLD = os.environ.get("KVTAX_FOLD", "1").strip().lower() not in ("0", "off", "false")


def folds(checked: list[Any]) -> bool:
    """Whether q4's two parts, planned to run side by side (`beside`, `make_room`), take
    ONE launch: the Gluon swap kernel with the fp16 part's splits as its first programs
    (decode_swap_gluon.py's FOLD, ring_part_gluon.py). Why: the part's own launch put the
    body's start ~2 µs behind it at 128k on an H100, whatever its plan (docs/KERNELS.md).

    Where: a float part (fp16 or bf16; a ring read through a window, no other masks)
    before a body the Gluon kernel serves, the same queries, lengths and
    score scale, no soft-capping."""
    if not FOLD or len(checked) != 2 or not checked[-1].cfg.pdl_beside:
        return False
    ring, body = checked
    v = ring.view
    return (body.cfg.kernel == "swap" and not body.softcap and not ring.softcap
            and not (v.spec.key.is_quantized or v.spec.value.is_quantized)
            and v.ring > 0 and v.window is not None and not any(ring.masks.values())
            and v.k.codes.dtype == v.v.codes.dtype
            and v.k.codes.dtype in (torch.float16, torch.bfloat16)
            and v.head_dim == body.view.head_dim and ring.q is body.q
            and ring.lengths is body.lengths and v.length == body.view.length
            and ring.qk_scale == body.qk_scale
            and gluon_swap_reason(body.q, body.view) is None)
