"""A tiny fork server: import torch once, then fork one fresh child per cell.

    python -m kvtax.harness.bench.forkserver     # driven by executor.ForkserverExecutor

Protocol (JSON lines): the parent writes one cell per line on stdin. For each, the server
forks; the child writes `{"pid": n}`, then `{"phase": name}` as it goes and finally
`{"row": {...}}` on the protocol stream, and exits; the server then writes
`{"exit": status}` (the child's wait status) and waits for the next cell.

Why not multiprocessing's forkserver: it re-imports the parent's `__main__` in every child,
which breaks under `python -` and stdin scripts and costs time under pytest. Why fork at
all: torch's import takes seconds, and a child forked from a server that never ran a
kernel is as fresh as a new interpreter — no allocator state, no CUDA context, no earlier
cell's tensors. Each child and the server die with their parent (PR_SET_PDEATHSIG), so a
SIGKILLed sweep leaves nothing running.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch  # noqa: F401 - the point of the server: pay this import once

from kvtax.harness.bench import cells  # noqa: F401 - preload
from kvtax.harness.lifeline import die_with_parent
from kvtax.harness.bench.worker import measure


def preload() -> None:
    """Pay torch's lazy imports here, once, instead of in every child.

    Building a module under `torch.device("meta")` (what model loading does) imports
    torch._refs/_prims and friends on first use — seconds on a busy machine. Meta tensors
    allocate nothing and start no threads, so the children stay fresh.
    """
    try:
        from kvtax.models import get_config
        from kvtax.models.decoder import DecoderModel

        with torch.device("meta"):
            DecoderModel(get_config("tiny"))
    except Exception:  # models unavailable: children import on demand
        pass


def _child(cell: dict, proto_fd: int) -> None:
    die_with_parent()
    # Its own process group: a timed-out cell is killed with everything it started
    # (e.g. a compiler building an extension), which would otherwise run on and skew
    # the next cells' timings.
    os.setpgid(0, 0)
    proto = os.fdopen(proto_fd, "w", buffering=1)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the protocol stream

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj, default=str) + "\n")
        proto.flush()

    send({"pid": os.getpid()})
    row = measure(cell, lambda p: send({"phase": p}))
    send({"row": row})


def serve() -> None:
    die_with_parent()
    preload()
    out = sys.stdout
    for line in sys.stdin:
        if not line.strip():
            continue
        cell = json.loads(line)
        out.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(cell, os.dup(out.fileno()))
            except BaseException:  # noqa: BLE001 - the parent turns this into an error row
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"exit": status}) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
