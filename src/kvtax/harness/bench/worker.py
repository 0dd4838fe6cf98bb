"""The child side of a cell: measure it in this (fresh) process and produce one row.

    python -m kvtax.harness.bench.worker '<cell json>'      # or the JSON on stdin

prints exactly one JSON row on stdout's last line; phase changes go to stderr as
`KVTAX_PHASE <name>` so a parent can say where a cell died even when nothing came back.

Failures never escape as exceptions: an out-of-memory becomes `status: "oom"` with the
phase it happened in, an engine arm that cannot run here (EngineUnavailable, e.g. a
compiled arm over a cache that cannot be compiled) `status: "unavailable"` with the
reason, anything else `status: "error"` with its text. Forced faults for
tests: `KVTAX_FORCE_OOM=<phase>[:<substring of cell_id>]` raises torch.OutOfMemoryError
at that phase's start; `cell["mem_limit_bytes"]` caps this process's address space
(RLIMIT_AS) that many bytes above its size at cell start, so a real allocation fails.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from kvtax.harness.engines.base import EngineUnavailable
from kvtax.harness.schema import base_row, utc_now

PHASE_MARK = "KVTAX_PHASE"
FORCE_ENV = "KVTAX_FORCE_OOM"
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, MemoryError, or an allocator failure by its message."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in _OOM_TEXT)


def forced_phase(cell: dict[str, Any]) -> str | None:
    """The phase KVTAX_FORCE_OOM (or cell["force_oom"]) asks to fail in, for this cell."""
    spec = os.environ.get(FORCE_ENV, "").strip()
    if not spec:
        return cell.get("force_oom")
    phase, _, match = spec.partition(":")
    return phase if not match or match in cell["cell_id"] else cell.get("force_oom")


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def limit_memory(extra_bytes: int) -> None:
    """Cap the address space at its current size plus `extra_bytes` (Linux)."""
    cap = _vm_size() + int(extra_bytes)
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def _release(device: str) -> None:
    """Drop what the failed phase left so building the row cannot fail for lack of memory."""
    import gc

    gc.collect()
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(
    cell: dict[str, Any], on_phase: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run `cell` here and return its complete row (never raises for a cell failure).

    `cell` is `plan.Cell.to_dict()` plus `run_id`, `device_name` and `git_commit`.
    """
    from kvtax.harness.bench.cells import run_cell

    row = base_row(
        cell,
        run_id=cell.get("run_id", ""),
        device=cell.get("device_name", cell.get("device", "")),
        git_commit=cell.get("git_commit"),
    )
    phase = {"now": "setup"}

    def hook(p: str) -> None:
        phase["now"] = p
        if on_phase:
            on_phase(p)

    cell = dict(cell, force_oom=forced_phase(cell))
    partial: dict[str, Any] = {}
    try:
        if cell.get("mem_limit_bytes"):
            limit_memory(int(cell["mem_limit_bytes"]))
        if cell.get("threads"):
            torch.set_num_threads(int(cell["threads"]))
        row.update(run_cell(cell, hook, partial))
        row["status"], row["phase"], row["error"] = "ok", None, None
    except BaseException as exc:  # noqa: BLE001 - every failure must become a row
        if isinstance(exc, KeyboardInterrupt):
            raise
        _release(str(cell.get("device", "")))
        # Phases that finished before the failure keep their numbers (e.g. TTFT before a
        # decode OOM); the failing phase's own half-measured fields are dropped.
        failed = phase["now"]
        row.update({k: v for k, v in partial.items() if not k.startswith(failed + "_")})
        row["status"] = ("oom" if is_oom(exc) else
                         "unavailable" if isinstance(exc, EngineUnavailable) else "error")
        row["phase"] = phase["now"]
        tb = traceback.format_exception_only(type(exc), exc)
        row["error"] = "".join(tb).strip()[:2000]
        if row["status"] == "error":
            row["traceback"] = traceback.format_exc()[-4000:]
    row["timestamp"] = utc_now()
    return row


def child_main(cell: dict[str, Any], conn: Any) -> None:
    """Forkserver entry: stream phases and the row back through `conn`."""
    try:
        row = measure(cell, lambda p: conn.send(("phase", p)))
        conn.send(("row", row))
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = argv[0] if argv and argv[0] != "-" else sys.stdin.read()
    cell = json.loads(text)

    def mark(p: str) -> None:
        print(f"{PHASE_MARK} {p}", file=sys.stderr, flush=True)

    row = measure(cell, mark)
    sys.stdout.write(json.dumps(row, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
