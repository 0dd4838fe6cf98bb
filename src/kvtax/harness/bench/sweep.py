"""The parent loop of `kvtax bench`: plan, skip what is done, run each cell, append its row.

    >>> run = run_sweep(SweepConfig(level="attention", contexts=[256]), out="runs")
    >>> run.path / "rows.jsonl"

Rows are fsynced one by one (store.RunStore.append) before the next cell starts; a sweep
killed at any point and resumed with the same folder re-plans the same cells in the same
order (same seed) and runs only those without a row.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from kvtax.harness.bench.executor import failure_row, make_executor
from kvtax.harness.bench.plan import Cell, SweepConfig, context_limit, plan_cells
from kvtax.harness.store import RunStore, environment

Printer = Callable[[str], None]
# What a bench config.json must hold to be resumed: the keys that define its cells.
RESUME_KEYS = ("model", "level", "contexts", "kvs", "paths", "reps", "seed")


def hf_quantized_unavailable(
    kv: str | None = None, model: str | None = None, level: str = "model"
) -> str | None:
    """Why transformers' QuantizedCache cannot run here for `kv` on `model` (None: it can)."""
    if level != "model":
        return "hf-quantized is a whole-model arm (transformers' own model and cache)"
    from kvtax.harness.bench.hf_quantized import hf_quantized_unavailable as why

    return why(kv, model)


def skip_reason(cell: Cell, cfg: SweepConfig, tripped: dict[str, tuple[int, str]]) -> str | None:
    """Why `cell` is written as a "skipped" row instead of run (None: run it)."""
    limit = context_limit(cfg, cell.kv, cell.path)
    if limit == 0:
        return f"skipped: {cell.arm} is left out of this sweep (max_context 0 in its config)"
    if limit is not None and cell.context > limit:
        return (f"skipped: context {cell.context} is above max_context {limit} for "
                f"{cell.arm} (a budget choice in the sweep config, not a failure)")
    hit = tripped.get(cell.arm)
    if cfg.skip_after_failure and hit and cell.context >= hit[0]:
        return (f"skipped: {cell.arm} already hit {hit[1]} at context {hit[0]} in this run "
                "(skip_after_failure)")
    return None


def budget_skip(estimate_s: float, budget_s: float) -> str:
    """The reason on the row of a cell that alone would outlast a whole time budget."""
    return (f"skipped: estimated {estimate_s:.0f} s (same arm's measured cells) is more than "
            f"the whole time budget of {budget_s:.0f} s (--budget-s)")


def _trip(tripped: dict[str, tuple[int, str]], row: dict[str, Any]) -> None:
    """Remember the smallest context at which an arm ran out of memory or time."""
    if row.get("status") in ("oom", "timeout"):
        arm, ctx = str(row["arm"]), int(row["context"])
        if arm not in tripped or ctx < tripped[arm][0]:
            tripped[arm] = (ctx, str(row["status"]))


class CellClock:
    """Wall seconds of finished cells, to guess whether the next one fits a time budget.

    A cell costs setup + per-token x context. Measured cells of the same arm give the line
    through the two nearest contexts (above the largest: the power law through them, since
    prefill grows faster than linearly; one context: the cheapest cell seen is the setup).
    Warm-ups are kept apart: they also pay for compiling and starting the worker, so
    scaling one up by context refused every later cell of a sweep. Unknown: 0 (run it).
    """

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], float] = {}
        self.warm: dict[tuple[str, int], float] = {}

    def add(self, cell: Cell, seconds: float) -> None:
        book = self.warm if cell.warmup else self.seen
        key = (cell.arm, cell.context)
        book[key] = max(seconds, book.get(key, 0.0))

    def estimate(self, cell: Cell) -> float:
        """Seconds `cell` will likely take (0.0 when nothing measured says)."""
        if cell.warmup:
            return self.warm.get((cell.arm, cell.context), max(self.warm.values(), default=0.0))
        if (cell.arm, cell.context) in self.seen:
            return self.seen[(cell.arm, cell.context)]
        mine = {c: s for (a, c), s in self.seen.items() if a == cell.arm}
        if not mine:
            return max((s for (_a, c), s in self.seen.items() if c == cell.context), default=0.0)
        setup = min(self.seen.values())
        near = sorted(mine, key=lambda c: abs(c - cell.context))[:2]
        if len(near) == 1:
            (c1,) = near
            return setup + max(0.0, mine[c1] - setup) * cell.context / c1
        (c1, s1), (c2, s2) = sorted((c, mine[c]) for c in near)
        if cell.context > c2 and s2 > s1 > setup:
            # Above every measured context, a line under-estimates: prefill attention is
            # quadratic in context (the unfused arm: 12.5 s at 32k, ~4x that at 64k). Scale
            # the cost past setup by the power the two nearest contexts show, in [1, 2].
            power = min(2.0, max(1.0, math.log((s2 - setup) / (s1 - setup)) / math.log(c2 / c1)))
            return setup + (s2 - setup) * (cell.context / c2) ** power
        per_token = max(0.0, (s2 - s1) / (c2 - c1))
        return max(setup, s1 + per_token * (cell.context - c1))


def _fmt_secs(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _summary(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        err = (row.get("error") or "").splitlines()[-1:] or [""]
        return f"{row['status']} in {row.get('phase')}: {err[0][:100]}"
    parts = []
    if row.get("ttft_s") is not None:
        parts.append(f"ttft {row['ttft_s'] * 1e3:.1f} ms")
    if row.get("decode_ms_per_token") is not None:
        parts.append(f"{row['decode_ms_per_token']:.2f} ms/tok")
    if row.get("decode_growth"):
        parts.append("cache grew in decode window")
    return "ok " + ", ".join(parts)


def run_sweep(
    cfg: SweepConfig,
    *,
    out: str = "runs",
    name: str | None = None,
    resume: str | None = None,
    print_fn: Printer | None = None,
    stream: TextIO | None = None,
    cell_overrides: dict[str, Any] | None = None,
    command: str | None = None,
    budget_s: float | None = None,
) -> RunStore:
    """Run (or resume) a sweep; returns the run folder's store.

    `cell_overrides` adds keys to every cell payload (e.g. `mem_limit_bytes`, `threads`).
    `budget_s`: start no cell that would likely end past this many seconds from now (see
    CellClock); those wait for --resume, and a cell estimated longer than the whole budget
    becomes a "skipped" row saying so.
    """
    stream = stream or sys.stdout
    say = print_fn or (lambda s: print(s, file=stream, flush=True))
    store, cfg, cell_overrides = _open_store(cfg, out, name, resume, cell_overrides, command,
                                             say)
    env = environment(cfg.device)
    store.write_env(env)

    cells = plan_cells(cfg)
    done = store.done_cell_ids()
    todo = [c for c in cells if c.cell_id not in done]
    total = len(cells)
    say(f"{total} cells ({len(cells) - len(todo)} already done), order seed {cfg.seed}, "
        f"{cfg.level}-level, model {cfg.model}, device {env['device']}"
        + ("" if cfg.engine == "kvtax" else f", engine {cfg.engine}"))
    hf_reasons = _hf_reasons(cfg, todo, say)
    base = baseline_of(cfg)
    tripped: dict[str, tuple[int, str]] = {}
    for r in store.rows():  # a resumed run remembers the failures of earlier calls
        _trip(tripped, r)
    executor = make_executor(cfg.worker, cfg.timeout_s)
    to_run = sum(1 for c in todo if not (c.path == "hf-quantized" and hf_reasons.get(c.kv))
                 and skip_reason(c, cfg, {}) is None)
    t_start = t_first = time.monotonic()
    ran = executed = 0
    clock = CellClock()
    left: list[Cell] = []  # cells the time budget did not reach
    cold: set[str] = set()  # arms whose warm-up was left for a later call
    try:
        for cell in todo:
            payload = dict(_payload(cell, store, env, cell_overrides),
                           **({"baseline_arm": base} if base else {}))
            guess = clock.estimate(cell)
            refused = _refusal(cell, cfg, tripped, hf_reasons, guess, budget_s)
            if refused:
                store.append(failure_row(payload, refused[0], None, refused[1]))
                ran += 1
                continue
            if budget_s is not None and (cell.arm in cold
                                         or time.monotonic() - t_start + guess > budget_s):
                left.append(cell)  # fits a later call: --resume runs it; smaller ones go on
                if cell.warmup:  # ...but no arm is measured before its warm-up
                    cold.add(cell.arm)
                continue
            say(f"[{total - len(todo) + ran + 1}/{total}]"
                f"{_eta(executed, t_first, to_run)} {_label(cell)} ...")
            t_cell = time.monotonic()
            row = executor.run(payload)
            store.append(row)
            clock.add(cell, time.monotonic() - t_cell)
            _trip(tripped, row)
            ran, executed = ran + 1, executed + 1
            t_first = time.monotonic() if executed == 1 else t_first
            say(f"    {_summary(row)}")
    finally:
        executor.close()
    if left:
        say(f"time budget of {_fmt_secs(budget_s or 0)} reached: {len(left)} cell(s) not run; "
            f"finish with: kvtax bench --resume {store.path}")
    say(f"done: {ran} cells in {_fmt_secs(time.monotonic() - t_start)}; rows in "
        f"{store.rows_path}")
    return store


def _label(cell: Cell) -> str:
    return f"{cell.arm} ctx={cell.context} rep={cell.rep}" + (
        " (warm-up)" if cell.warmup else "")


def _eta(executed: int, t_first: float, to_run: int) -> str:
    """" ETA 3m 10s" from the cells run since the first (which also paid for starting the
    fork server); "" before two have run."""
    if executed < 2:
        return ""
    per = (time.monotonic() - t_first) / (executed - 1)
    return f" ETA {_fmt_secs(per * max(0, to_run - executed))}"


def _open_store(cfg: SweepConfig, out: str, name: str | None, resume: str | None,
                cell_overrides: dict[str, Any] | None, command: str | None,
                say: Printer) -> tuple[RunStore, SweepConfig, dict[str, Any] | None]:
    """The run folder (reopened on `resume`, whose config and overrides then apply), the
    sweep config and the cell overrides in effect."""
    if resume:
        store = RunStore.open(resume, kind="bench", required=RESUME_KEYS)
        stored = store.config()
        cfg = SweepConfig.from_dict(stored)
        cell_overrides = dict(stored.get("cell_overrides") or {}, **(cell_overrides or {}))
        check_engine(cfg)
        say(f"resuming {store.path}")
        return store, cfg, cell_overrides
    check_engine(cfg)
    # Flat: the sweep's fields at top level (cv_threshold, claims... are what reports read).
    config = dict(cfg.to_dict(), kind="bench", cell_overrides=cell_overrides or {},
                  argv=sys.argv, command=command)
    default = (f"bench-{Path(cfg.model).name}" if cfg.engine == "kvtax"
               else f"bench-{cfg.engine}-{Path(cfg.model).name}")
    store = RunStore.create(out, name or default, config)
    say(f"run folder {store.path}")
    return store, cfg, cell_overrides


def _hf_reasons(cfg: SweepConfig, todo: list[Cell], say: Printer) -> dict[str, str | None]:
    """Why each kv's hf-quantized arm cannot run here (None: it can), said once each."""
    if cfg.engine != "kvtax":
        return {}
    reasons = {kv: hf_quantized_unavailable(kv, cfg.model, cfg.level)
               for kv in sorted({c.kv for c in todo if c.path == "hf-quantized"})}
    for kv, why in reasons.items():
        if why:
            say(f"{kv}/hf-quantized is unavailable here (rows say so): {why}")
    return reasons


def _refusal(cell: Cell, cfg: SweepConfig, tripped: dict[str, tuple[int, str]],
             hf_reasons: dict[str, str | None], guess: float,
             budget_s: float | None) -> tuple[str, str] | None:
    """(status, why) of a cell written as a row without running, else None."""
    why = hf_reasons.get(cell.kv) if cell.path == "hf-quantized" else None
    if why:
        # Written, not skipped: the report must show the arm could not run, and why.
        return "unavailable", why
    why = skip_reason(cell, cfg, tripped)
    if why:
        return "skipped", why
    if budget_s is not None and guess > budget_s:  # no call of this budget can run it
        return "skipped", budget_skip(guess, budget_s)
    return None


def check_engine(cfg: SweepConfig) -> None:
    """Raise EngineUnavailable (one line naming the install command) when the sweep's
    engine cannot run here, before any folder is made or cell runs."""
    if cfg.engine != "kvtax":
        from kvtax.harness.engines import require_engine

        require_engine(cfg.engine)


def baseline_of(cfg: SweepConfig) -> str | None:
    """Another engine's baseline arm name (its unquantized cache); None for kvtax, whose
    statistics pick fp16 themselves (stats.baseline_arm)."""
    if cfg.engine == "kvtax":
        return None
    from kvtax.harness.engines import get_engine
    from kvtax.harness.schema import arm_name

    arm = get_engine(cfg.engine).baseline_arm(cfg.arms())
    return arm_name(*arm) if arm else None


def _payload(
    cell: Cell, store: RunStore, env: dict[str, Any], overrides: dict[str, Any] | None
) -> dict[str, Any]:
    d = cell.to_dict()
    d.update(run_id=store.run_id, device_name=env["device"], git_commit=env.get("git_commit"))
    d.update(overrides or {})
    return d
