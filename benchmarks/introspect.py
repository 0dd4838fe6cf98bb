"""What a timed decode cell ran with, beside its time: the evidence for process-history effects.

The full attention grid times kvtax decode at 128k ~11% slower than a grid without the
unfused arm's prefill cells, with identical PTX. These records let two runs be compared on
what could differ between them: how many specializations of each Triton kernel the process
compiled (Triton specializes on pointer alignment and on integers equal to 1 or divisible
by 16, so a history that hands a kernel a differently aligned tensor compiles and runs
another variant), where each tensor the kernel reads lies (address modulo 2 MiB / 64 KiB
pages, its caching-allocator segment's size), and the SM / memory clocks around the cell.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import torch

KERNEL_MODULES = ("kvtax.attention.kernels.decode", "kvtax.attention.kernels.decode_swap",
                  "kvtax.attention.kernels.decode_warp", "kvtax.attention.kernels.reduce",
                  "kvtax.attention.kernels.decode_swap_gluon", "kvtax.attention.kernels.prefill")


def compiled_variants() -> dict[str, list[str]]:
    """Kernel name -> the specialization keys the process compiled it for (all devices)."""
    from triton.runtime.jit import JITFunction

    out: dict[str, list[str]] = {}
    for name in KERNEL_MODULES:
        mod = sys.modules.get(name)
        for attr, fn in sorted(vars(mod).items() if mod else []):
            if not isinstance(fn, JITFunction):
                continue
            keys: list[str] = []
            for entry in getattr(fn, "device_caches", {}).values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                keys += [str(k)[:400] for k in cache]
            if keys:
                out[f"{name.rsplit('.', 1)[1]}.{attr}"] = keys
    return out


def placement(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Per tensor: address mod 2 MiB and 64 KiB, bytes, and its allocator segment's size
    and the tensor's offset in it (None on CPU)."""
    segments = []
    if torch.cuda.is_available():
        segments = [(s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()]
    out = {}
    for name, t in tensors.items():
        ptr = t.data_ptr()
        seg = next(((a, n) for a, n in segments if a <= ptr < a + n), None)
        out[name] = dict(mod_2m=ptr % (2 << 20), mod_64k=ptr % (64 << 10),
                         nbytes=t.numel() * t.element_size(),
                         segment_bytes=seg[1] if seg else None,
                         segment_offset=ptr - seg[0] if seg else None)
    return out


def clocks() -> dict[str, Any] | None:
    """SM and memory clocks (MHz), temperature and power now, from nvidia-smi (None: none)."""
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
        ).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    sm, mem, temp, power = (x.strip() for x in line.split(","))
    return dict(sm_mhz=sm, mem_mhz=mem, temp_c=temp, power_w=power)


def record(view: Any, q: torch.Tensor, extra: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The introspection record of one decode cell over `view` (a CacheView) with query q."""
    tensors = {"q": q, **extra}
    for side in ("k", "v"):
        part = getattr(view, side)
        for field in ("codes", "scales", "biases"):
            t = getattr(part, field, None)
            if isinstance(t, torch.Tensor):
                tensors[f"{side}.{field}"] = t
    return dict(variants={k: len(v) for k, v in compiled_variants().items()},
                placement=placement(tensors), clocks=clocks())
