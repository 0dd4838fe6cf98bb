"""Roofline measurements: the device's streaming bandwidth and matmul rate, and how close
each attention path gets to them over a cache of a given format and context.

A published mlx-lm measurement (M5 Pro) ruled out "the kernel is just slow" before blaming
bandwidth: its attention read memory at 98% of the measured streaming rate, with 109x more
compute available than used. The same two numbers, for every path here:

- bytes that must move for one decode-attention call: the cache's K and V (codes, scales,
  biases) plus q and the output; achieved GB/s = bytes / time, fraction = / streaming peak;
- FLOPs that must happen: 4 * H_q * context * D (q·K and p·V); headroom = matmul peak /
  achieved FLOP rate.

    >>> bw = stream_bandwidth(torch.device("cuda"))      # {"read": GB/s, "copy": GB/s}
    >>> r = attention_roofline("int4", "fused", 32768, (32, 8, 128), device, torch.bfloat16)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvtax.cache import make_caches
from kvtax.formats.hybrid import parse_kv
from kvtax.attention.baselines import attention_for


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], object], device: torch.device, iters: int = 20,
            warmup: int = 3) -> float:
    """Median seconds per call of `fn` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    if device.type == "cuda":
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def stream_bandwidth(device: torch.device, nbytes: int | None = None,
                     iters: int = 20) -> dict[str, float]:
    """Achievable streaming GB/s: a read-only reduction and a copy (read + write) of `nbytes`.

    Default size: 2 GiB on CUDA (far beyond any cache level), 256 MiB on CPU.
    """
    nbytes = nbytes or (2 << 30 if device.type == "cuda" else 256 << 20)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    t_read = time_op(lambda: x.sum(), device, iters)
    t_copy = time_op(lambda: y.copy_(x), device, iters)
    return {"read": nbytes / t_read / 1e9, "copy": 2 * nbytes / t_copy / 1e9, "bytes": nbytes}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int | None = None,
                iters: int = 10) -> float:
    """Achievable TFLOP/s of an n x n x n matmul in `dtype` (n: 8192 CUDA, 1024 CPU)."""
    n = n or (8192 if device.type == "cuda" else 1024)
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32  # CPU half matmuls are emulated; fp32 is the honest ceiling
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = time_op(lambda: a @ b, device, iters)
    return 2 * n**3 / t / 1e12


def attention_roofline(
    kv: str,
    path: str,
    context: int,
    shape: tuple[int, int, int],
    device: torch.device,
    dtype: torch.dtype,
    iters: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """One decode-attention call (one query per head) over a `context`-token cache."""
    hq, hkv, d = shape
    spec = parse_kv(kv)
    gen = torch.Generator(device=device).manual_seed(seed)
    (cache,) = make_caches([None], spec, capacity=context)  # a hybrid spec (q4): HybridCache
    step = 8192  # fill in slices so the fp16 K/V never exist for the whole context at once
    for s in range(0, context, step):
        t = min(step, context - s)
        k = torch.randn(1, hkv, t, d, generator=gen, device=device, dtype=dtype)
        v = torch.randn(1, hkv, t, d, generator=gen, device=device, dtype=dtype)
        cache.append(k, v)
        del k, v
    q = torch.randn(1, hq, 1, d, generator=gen, device=device, dtype=dtype)
    fn = attention_for(path)
    view = cache.view()
    sec = time_op(lambda: fn(q, view), device, iters)
    itemsize = torch.empty((), dtype=dtype).element_size()
    moved = cache.used_nbytes + 2 * q.numel() * itemsize
    flops = 4 * hq * context * d
    return {"time_s": sec, "bytes_moved": moved, "flops": flops,
            "achieved_gbs": moved / sec / 1e9, "achieved_tflops": flops / sec / 1e12}
