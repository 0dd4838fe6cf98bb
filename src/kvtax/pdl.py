"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A batch-1 decode step is ~240 short kernels, and on the H200 each boundary between two
of them leaves the memory system idle for ~2.5 µs (benchmarks/kernel_floor.py; notes/
KERNELS.md). Launched with PDL (`launch_pdl=True`, sm_90+), a kernel may
start while the one before it still runs, once every program of that one has executed
`griddepcontrol.launch_dependents`; it must then execute `griddepcontrol.wait` before it
touches memory the kernels before it write. kvtax's decode-step kernels (the fused
GEMVs, the cache store, the decode attention kernels and their split-KV reduce) all wait
first thing and trigger first thing (or, where a launch config says so, at their end), when
built with their PDL constexprs: the boundary's launch latency overlaps the previous
kernel's tail, and every kernel still sees everything before it finished (a kernel's
wait returns once the previous kernel has completed, and that one waited for its own
predecessor first, so the order is transitive).

`USE_PDL` (environment `KVTAX_PDL=0` turns it off) is read at each launch. Every family
in FAMILIES is launched with PDL and lets its dependents launch first thing; a decode
attention kernel's own launch config may instead launch normally or let go at its end
(kvtax.attention's swap/warp decode configs: the placement measured best per grid).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

USE_PDL = os.environ.get("KVTAX_PDL", "1").strip().lower() not in ("0", "off", "false")
# the kernel families of a decode step, all launched with PDL when USE_PDL holds
FAMILIES = frozenset({"gemv", "store", "attention", "reduce"})


@lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(kind: str, t: torch.Tensor, interpreting: bool) -> bool:
    """Whether a kernel of family `kind` on `t`'s device builds its PDL code (trigger and
    wait): USE_PDL, a compiled (not interpreted) kernel on an sm_90+ CUDA device."""
    if kind not in FAMILIES:
        raise ValueError(f"unknown PDL kernel family {kind!r} (one of {sorted(FAMILIES)})")
    if not (USE_PDL and t.is_cuda) or interpreting:
        return False
    return _sm90(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_options(kind: str, t: torch.Tensor, interpreting: bool) -> dict:
    """The launch keywords of a kernel whose PDL constexpr is named `PDL`: {} when off,
    else PDL and launch_pdl on (the dependents launch first thing; the decode attention
    launcher narrows these and adds its kernels' `PDL_LATE`)."""
    if not enabled(kind, t, interpreting):
        return {}
    return {"PDL": True, "launch_pdl": True}
