"""Timing shared by the GPU benchmarks: CUDA-graph replays with L2 flushed before each.

Every arm of a benchmark is timed the same way: the call is captured in
a CUDA graph after two warm-up calls on a side stream, replayed (L2 evicted before each) for
at least `warmup_ms` of wall time, then replayed `reps` times, each replay after a 256 MiB
write (or read) that evicts L2, timed with CUDA events; median and p20 / p80 in ms. `dry`
(CPU, interpreter): wall-clock of `dry_calls` eager calls.

Why a warm-up by time (triton's do_bench warms up 25 ms for the same reason): on an H200
the first decode cell timed right after ~4 s of heavy prefill cells ran 10-11% slow,
whichever kernel it was (fp16 0.1545 vs 0.1388 ms, int8 0.0900 vs 0.0815 at 128k), while a
second cell 30 ms later, or the same cell after a 5 s pause, ran at full speed
(benchmarks/decode_history.py, docs/BENCHMARKS.md "Decode speed and what ran before it").
"""

from __future__ import annotations

import statistics
import subprocess
import time

import torch


WARMUP_MS = 100.0  # replays before timing; the transient above lasted < 30 ms


class Timer:
    """Median / p20 / p80 ms of a CUDA-graph replay of `fn`, L2 flushed before each."""

    def __init__(self, reps: int, dry: bool, flush: str = "write", dry_calls: int = 3,
                 warmup_ms: float = WARMUP_MS) -> None:
        self.reps, self.dry, self.mode, self.dry_calls = reps, dry, flush, dry_calls
        self.warmup_ms = warmup_ms
        self.flush = None if dry else torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def evict(self) -> None:
        """Push the timed call's data out of L2: a 256 MiB write (the dirty lines it leaves
        are written back during the next call) or read (clean lines, nothing to write)."""
        if self.mode == "write":
            self.flush.zero_()
        else:
            torch.amax(self.flush.view(torch.int32))

    def __call__(self, fn) -> tuple[float, float, float]:
        return stats(self.samples(fn))

    def samples(self, fn, reps: int | None = None) -> list[float]:
        """ms of each of `reps` (default self.reps) timed replays of `fn`, in order."""
        reps = self.reps if reps is None else reps
        if self.dry:  # the interpreter: a few wall-clock calls, the number meaningless
            if self.dry_calls > 1:
                fn()
            ts = []
            for _ in range(self.dry_calls):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return ts
        graph = self._capture(fn)
        events = []
        for _ in range(reps):
            self.evict()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        ts = [s.elapsed_time(e) for s, e in events]
        del graph
        return ts

    def replay_spans(self, fn, reps: int | None = None) -> list[list[tuple[str, float, float]]]:
        """Kernel spans (name, start µs, end µs) inside each of `reps` timed replays of
        `fn`'s graph, captured and warmed up as `samples` does, L2 evicted before each; from
        torch.profiler (CUPTI reports the kernels inside a replayed graph). The eviction's
        own kernels separate the replays and are left out."""
        from torch.profiler import ProfilerActivity, profile

        from kvtax.harness.bench.step_profile import kernel_spans

        reps = self.reps if reps is None else reps
        graph = self._capture(fn)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.evict()
            torch.cuda.synchronize()
        flush = {name for name, _, _ in kernel_spans(prof)}
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                self.evict()
                graph.replay()
            torch.cuda.synchronize()
        del graph
        return split_replays(kernel_spans(prof), flush)

    def _capture(self, fn) -> torch.cuda.CUDAGraph:
        """`fn` captured (`capture_graph`), then replayed for warmup_ms."""
        graph = capture_graph(fn)
        self._warm(graph)
        return graph

    def _warm(self, graph) -> None:
        """Replay `graph` (evicting L2 before each) until warmup_ms of wall time passed."""
        if self.warmup_ms <= 0:
            return
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1e3 < self.warmup_ms:
            for _ in range(8):
                self.evict()
                graph.replay()
            torch.cuda.synchronize()


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph after two warm-up calls on a side stream (which compile
    and allocate off the capture), and replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    return graph


def split_replays(spans: list[tuple[str, float, float]],
                  separators: set[str]) -> list[list[tuple[str, float, float]]]:
    """`spans` (name, start, end) in start order, cut into the runs between kernels named
    in `separators` (the L2 eviction before each replay), which are dropped."""
    runs: list[list[tuple[str, float, float]]] = [[]]
    for span in sorted(spans, key=lambda s: s[1]):
        if span[0] in separators:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append(span)
    return [r for r in runs if r]


def stats(ts: list[float]) -> tuple[float, float, float]:
    """Median, p20, p80 of `ts`."""
    ts = sorted(ts)
    q = lambda f: ts[min(len(ts) - 1, int(f * (len(ts) - 1) + 0.5))]  # noqa: E731
    return statistics.median(ts), q(0.2), q(0.8)


def git_commit() -> str:
    """The checkout's short commit, recorded beside each run's timings ("unknown" where
    the tree has no .git, as on the device's copy)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"
