"""One bench cell of any engine (`--engine NAME`), inside its worker process.

The same timeline as kvtax's own cells (harness.bench.timeline.Timeline): setup = `Engine.load`,
prefill = `Engine.prefill` of a `context`-token prompt (TTFT: up to the first generated
token), decode = `Engine.decode(decode_tokens)` (greedy, EOS ignored). Each phase's peak
comes from the engine's own MemoryCounter, reset at the phase's start. Before the measured
phases a short untimed prompt and one step run (when the engine can `reset` its cache), so
one-off costs land outside every window; one untimed step after prefill settles decode.

What the engine is given (EngineSpec): the cell's kv and path, threads, chunk_size (the
prefill chunk: llama.cpp's n_batch, mlx-lm's prefill_step_size), capacity = prompt +
every decode step the cell takes (what a presized cache must hold), and `options`: the
sweep's engine_options plus `presize` (whether the user asked for a presized cache).

Rows add `engine_version`, `engine_spec` (the arm's settings), `engine_info`
(`Engine.info()`, read after decode: e.g. the attention path that really ran) and
`baseline_arm` when the cell carries it.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch

from kvtax.harness.bench.timeline import WARMUP_TOKENS, PhaseHook, Timeline, finish_decode
from kvtax.harness.engines import Engine, EngineSpec, MemoryCounter, require_engine


class CounterMeter:
    """An engine's MemoryCounter behind PhaseMeter's interface (what Timeline reads).

    The counter is fetched at the first phase start: an engine builds it in `load`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.counter: MemoryCounter | None = None
        self.peaks: dict[str, int | None] = {}
        self.baselines: dict[str, int | None] = {}

    @property
    def kind(self) -> str | None:
        return self.counter.kind if self.counter is not None else None

    def start(self, name: str) -> None:
        """Phase `name` begins: reset the counter's peak, record its level (bytes)."""
        if self.counter is None:
            self.counter = self.engine.memory_counter()
        self.counter.reset()
        self.baselines[name] = self.counter.current()

    def stop(self, name: str) -> int | None:
        """Phase `name` ends: its peak bytes (None: not measurable)."""
        assert self.counter is not None, "stop() before start()"
        self.peaks[name] = self.counter.peak()
        return self.peaks[name]


def engine_spec(cell: dict[str, Any]) -> EngineSpec:
    """The EngineSpec of a planned cell (see the module docstring for what each field is)."""
    ctx, n_dec = int(cell["context"]), int(cell["decode_tokens"])
    options = dict(cell.get("engine_options") or {}, presize=bool(cell.get("presize")))
    return EngineSpec(
        model=str(cell["model"]), kv=str(cell["kv"]), path=str(cell["path"]),
        device=str(cell.get("device", "cpu")), dtype=str(cell.get("dtype", "float32")),
        seed=int(cell.get("seed", 0)), threads=cell.get("threads"),
        chunk_size=int(cell.get("chunk_size") or 2048),
        capacity=ctx + n_dec + 2, options=options,  # + the settle step and the first token
    )


def _can_reset(engine: Engine) -> bool:
    return type(engine).reset is not Engine.reset


def _warm(engine: Engine, cell: dict[str, Any]) -> None:
    """An untimed short prompt and one step, then an empty cache again."""
    n = max(1, min(int(cell["context"]), int(cell.get("chunk_size") or 2048), WARMUP_TOKENS))
    engine.prefill(engine.prompt_ids(n, int(cell.get("seed", 0)) + 1))
    engine.decode(1)
    engine.reset()


def engine_cell(
    cell: dict[str, Any], hook: PhaseHook | None = None, out: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Measure one cell on `cell["engine"]`; returns the bench-row fields it measured."""
    cls = require_engine(str(cell["engine"]))
    spec = engine_spec(cell)
    engine = cls(spec)
    device = torch.device("cuda" if spec.device.startswith("cuda") else "cpu")
    tl = Timeline(device, hook, cell, out, meter=CounterMeter(engine))
    out = tl.out
    out.update(engine_spec=asdict(spec), baseline_arm=cell.get("baseline_arm"))
    tl.enter("setup")
    try:
        out["engine_version"] = engine.version()
        t0 = time.perf_counter()
        engine.load()
        out["load_s"] = time.perf_counter() - t0
        if cell.get("extra", {}).get("inner_warmup", True) and _can_reset(engine):
            _warm(engine, cell)
        _measure(engine, cell, tl)
    finally:
        out["memory_kind"] = tl.meter.kind
        try:  # also on a failed cell: e.g. which attention path llama.cpp fell back to
            out["engine_info"] = engine.info()
        except Exception:  # noqa: BLE001 - the cell's own error is the one to report
            pass
        engine.close()
    out["level"] = "model"
    return out


def _measure(engine: Engine, cell: dict[str, Any], tl: Timeline) -> None:
    out, ctx, n_dec = tl.out, int(cell["context"]), int(cell["decode_tokens"])
    ids = engine.prompt_ids(ctx, int(cell.get("seed", 0)))
    if len(ids) != ctx:
        raise RuntimeError(f"engine {cell['engine']} made a {len(ids)}-token prompt, "
                           f"asked for {ctx}")
    measured = "prefill" in cell["phases"]
    if measured:
        tl.start("prefill")
    t0 = time.perf_counter()
    engine.prefill(ids)
    ttft = time.perf_counter() - t0
    if measured:
        tl.stop("prefill")
        out.update(ttft_s=ttft, prefill_tok_s=ctx / ttft if ttft > 0 else None)
    out["cache_bytes"] = engine.cache_bytes()
    out["bytes_per_token"] = engine.bytes_per_token()
    engine.decode(1)  # settle: the first step after prefill pays one-off costs
    if "decode" in cell["phases"] and n_dec > 0:
        tl.start("decode")
        samples = engine.decode(n_dec)
        tl.stop("decode")
        if len(samples) != n_dec:
            raise RuntimeError(f"engine {cell['engine']} timed {len(samples)} decode steps, "
                               f"asked for {n_dec}")
        finish_decode(out, [float(s) for s in samples])
