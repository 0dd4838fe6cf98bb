"""Shared pieces of the whole-model decode benchmarks (benchmarks/decode.py, stock_check.py).

Caches filled to a context with random K/V (no prefill through the model), decode steps
timed with CUDA events, the device's read bandwidth for the roofline, run metadata.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvtax.harness.bench.gpu_timer import Timer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def fill_random(caches, model, ctx: int, batch: int, chunk: int = 8192) -> None:  # noqa: ANN001
    """Append `ctx` random N(0,1) K/V tokens to every layer's cache, `chunk` at a time."""
    cfg = model.config
    dev, dtype = model.embed.weight.device, model.embed.weight.dtype
    gen = torch.Generator(device=dev).manual_seed(ctx)
    for cache in caches:
        for start in range(0, ctx, chunk):
            n = min(chunk, ctx - start)
            shape = (batch, cfg.num_kv_heads, n, cfg.head_dim)
            k = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
            v = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
            cache.append(k, v)


def time_steps(step, tok, n: int, budget_s: float) -> list[float]:  # noqa: ANN001
    """ms per decode step over up to `n` calls of `step(tok) -> next tok` (token ids `[B,
    1]`), stopping once `budget_s` seconds have passed: CUDA events around each step on
    CUDA, wall clock on CPU."""
    cuda = tok.is_cuda
    t_end = time.perf_counter() + budget_s
    if not cuda:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            tok = step(tok)
            times.append(1000 * (time.perf_counter() - t0))
            if time.perf_counter() > t_end:
                break
        return times
    events = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        tok = step(tok)
        end.record()
        events.append((start, end))
        if time.perf_counter() > t_end:
            break
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def kernel_read_ceiling() -> float:
    """Bytes/s: read_ceiling's best streaming read (CUDA graph, L2 flushed, median of 10)."""
    from kvtax.harness.bench.read_ceiling import read_ceiling  # Triton: imported when used

    tbps, _ = read_ceiling(Timer(reps=10, dry=False, flush="read"))
    torch.cuda.empty_cache()
    return tbps * 1e12


def measure_read_bandwidth(dev: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes/s: the better of a copy ((read + write) / t) and a sum (read / t), median of reps."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    y = torch.empty_like(x)

    def timed(fn) -> float:  # noqa: ANN001
        fn()
        samples = []
        for _ in range(reps):
            if dev.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                samples.append(s.elapsed_time(e) / 1000)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    copy_bw = 2 * nbytes / timed(lambda: y.copy_(x))
    sum_bw = nbytes / timed(lambda: x.sum())
    return max(copy_bw, sum_bw)


def weight_bytes_per_token(model) -> int:  # noqa: ANN001
    """Bytes one decode step must read: all weights, but one row of an untied embedding."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        e = model.embed.weight
        total -= e.numel() * e.element_size() - e.shape[1] * e.element_size()
    return total


def quantile(xs: list[float], q: float) -> float:
    """The `q`-quantile (0..1) of `xs`, nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def device_name(dev: torch.device) -> str:
    """The GPU's name (CUDA) or the host processor's."""
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"


def run_metadata(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype,
                 bw: float) -> dict:
    """What a benchmark's JSON records beside its rows: command, arguments, device, dtype,
    read bandwidth (bytes/s), torch version, commit and time."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    if len(commit) != 40:  # not a git checkout (e.g. a copied tree)
        commit = ""
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "device": device_name(dev),
        "dtype": str(dtype),
        "read_bw_Bps": bw,
        "torch": torch.__version__,
        "git_commit": commit,
        "timestamp": datetime.now(timezone.utc).isoformat(),
    }
