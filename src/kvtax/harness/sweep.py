"""The parent loop of `kvtax bench`: plan, skip what is done, run each cell, append its row.

    >>> run = run_sweep(SweepConfig(level="attention", contexts=[256]), out="runs")
    >>> run.path / "rows.jsonl"

Rows are fsynced one by one (store.RunStore.append) before the next cell starts; a sweep
killed at any point and resumed with the same folder re-plans the same cells in the same
order (same seed) and runs only those without a row.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from kvtax.harness.executor import failure_row, make_executor
from kvtax.harness.plan import Cell, SweepConfig, plan_cells
from kvtax.harness.store import RunStore, environment

Printer = Callable[[str], None]


def hf_quantized_unavailable() -> str | None:
    """Why transformers' QuantizedCache cannot run here (None when it can)."""
    try:
        from transformers.utils import is_hqq_available, is_optimum_quanto_available
    except ImportError as exc:
        return f"transformers is not importable ({exc})"
    if not (is_optimum_quanto_available() or is_hqq_available()):
        return (
            "transformers' QuantizedCache needs a backend: pip install optimum-quanto "
            "(or hqq); neither is installed"
        )
    return (
        "the hf-quantized arm needs a transformers model; kvtax bench drives kvtax's own "
        "decoder, so this arm is measured only through the HF adapter (not wired yet)"
    )


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
) -> RunStore:
    """Run (or resume) a sweep; returns the run folder's store.

    `cell_overrides` adds keys to every cell payload (e.g. `mem_limit_bytes`, `threads`).
    """
    stream = stream or sys.stdout
    say = print_fn or (lambda s: print(s, file=stream, flush=True))
    if resume:
        store = RunStore.open(resume)
        stored = store.config()
        cfg = SweepConfig.from_dict(stored)
        cell_overrides = dict(stored.get("cell_overrides") or {}, **(cell_overrides or {}))
        say(f"resuming {store.path}")
    else:
        # Flat: the sweep's fields at top level (cv_threshold, claims... are what reports read).
        config = dict(cfg.to_dict(), kind="bench", cell_overrides=cell_overrides or {},
                      argv=sys.argv, command=command)
        store = RunStore.create(out, name or f"bench-{cfg.model}", config)
        say(f"run folder {store.path}")
    env = environment(cfg.device)
    store.write_env(env)

    cells = plan_cells(cfg)
    done = store.done_cell_ids()
    todo = [c for c in cells if c.cell_id not in done]
    total = len(cells)
    say(
        f"{total} cells ({len(cells) - len(todo)} already done), order seed {cfg.seed}, "
        f"{cfg.level}-level, model {cfg.model}, device {env['device']}"
    )
    hf_reason = hf_quantized_unavailable()
    if hf_reason and any(c.path == "hf-quantized" for c in todo):
        say(f"hf-quantized arms are unavailable here (rows say so): {hf_reason}")
    executor = make_executor(cfg.worker, cfg.timeout_s)
    unavailable = [c for c in todo if c.path == "hf-quantized" and hf_reason]
    to_run = len(todo) - len(unavailable)
    t_start = t_first = time.monotonic()
    ran = executed = 0
    try:
        for cell in todo:
            payload = _payload(cell, store, env, cell_overrides)
            if cell.path == "hf-quantized" and hf_reason:
                # Written, not skipped: the report must show the arm could not run, and why.
                store.append(failure_row(payload, "unavailable", None, hf_reason))
                ran += 1
                continue
            label = f"{cell.arm} ctx={cell.context} rep={cell.rep}" + (
                " (warm-up)" if cell.warmup else ""
            )
            eta = ""
            if executed >= 2:  # the first cell also paid for starting the fork server
                per = (time.monotonic() - t_first) / (executed - 1)
                eta = f" ETA {_fmt_secs(per * (to_run - executed))}"
            say(f"[{total - len(todo) + ran + 1}/{total}]{eta} {label} ...")
            row = executor.run(payload)
            store.append(row)
            ran += 1
            executed += 1
            if executed == 1:
                t_first = time.monotonic()
            say(f"    {_summary(row)}")
    finally:
        executor.close()
    say(
        f"done: {ran} cells in {_fmt_secs(time.monotonic() - t_start)}; rows in "
        f"{store.rows_path}"
    )
    return store


def _payload(
    cell: Cell, store: RunStore, env: dict[str, Any], overrides: dict[str, Any] | None
) -> dict[str, Any]:
    d = cell.to_dict()
    d.update(run_id=store.run_id, device_name=env["device"], git_commit=env.get("git_commit"))
    d.update(overrides or {})
    return d
