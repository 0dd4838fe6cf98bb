"""Programmatic dependent launch (PDL) for the decode step's kernels, Hopper and newer.

    >>> from kvtax import pdl
    >>> on = pdl.enabled(x.device)               # CUDA, sm_90+, not switched off
    >>> kernel[grid](..., PDL=on, launch_pdl=on)  # the kernel calls pdl_start / pdl_wait

Why: a batch-1 decode step is a chain of ~330 short kernels (Llama-3.1-8B: 4 GEMVs, a
store and attention per layer). Without PDL each one starts only after the last program
of the one before it has exited, so every boundary leaves the memory system idle through
that kernel's tail and the next one's ramp-up. With PDL (launched with
`launch_pdl=True`) a kernel launches as soon as every program of the one before has
called `pdl_start`; its programs then do the work that depends on nothing the previous
kernels write (the GEMVs pull their first weight tiles into L2: `prefetch_l2`) and block
in `pdl_wait` (`griddepcontrol.wait`) until the previous grid has finished and its
writes are visible.

The rule every PDL kernel here keeps: before `pdl_wait`, no global store and no load of
anything a kernel of the step writes (weights and norm gains are read-only). A kernel
launched without the attribute waits for its predecessor as usual, and both instructions
are no-ops in a kernel launched without it, so kernels of other libraries (Inductor's)
may sit anywhere in the chain. CUDA graphs capture the launches with programmatic edges.

Switched off by `KVTAX_PDL=0` in the environment or `set_enabled(False)` (benchmarks
compare both); the interpreter never uses it (callers pass their `_interpreting()`).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_override: bool | None = None


def set_enabled(on: bool | None) -> None:
    """Force PDL on (where the device supports it) or off; None: back to the default
    (on, unless the environment sets KVTAX_PDL=0). Kernels launched afterwards follow it;
    a CUDA graph keeps what it captured."""
    global _override
    _override = on


def _env_on() -> bool:
    value = os.environ.get("KVTAX_PDL", "1").strip().lower()
    if value not in ("0", "1", "off", "on", "false", "true", ""):
        raise ValueError(f"KVTAX_PDL={value!r}: use 1 (on, the default) or 0 (off)")
    return value not in ("0", "off", "false")


@lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def trigger() -> int:
    """Where PDL kernels let the next kernel launch (experiment, KVTAX_PDL_TRIGGER):
    0 only at exit, 1 first thing (default), 2 after the main loop."""
    return {"exit": 0, "start": 1, "late": 2}[os.environ.get("KVTAX_PDL_TRIGGER", "start")]


def scope_all() -> bool:
    """KVTAX_PDL_SCOPE=gemv (experiment): only the GEMVs launch with PDL."""
    return os.environ.get("KVTAX_PDL_SCOPE", "all") == "all"


def enabled(device: torch.device, interpreting: bool = False) -> bool:
    """Whether kernels launched on `device` use PDL: a CUDA device of compute capability
    9.0 or newer, not under Triton's interpreter, and not switched off."""
    if interpreting or device.type != "cuda":
        return False
    if not (_env_on() if _override is None else _override):
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def pdl_start(PDL: tl.constexpr, TRIGGER: tl.constexpr = 1, AT: tl.constexpr = 1):
    """Let the next kernel launch now (it still waits for this one's writes in its own
    `pdl_wait`) if this call site `AT` is the launch's TRIGGER point (`trigger()`)."""
    if PDL and TRIGGER == AT:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the previous kernel has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs, PDL: tl.constexpr):
    """Pull the 128-byte lines holding `ptrs` (a pointer tensor, in bounds) into L2: one
    `prefetch.global.L2` per element, so pass one pointer per line."""
    if PDL:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
            is_pure=False, pack=1)
