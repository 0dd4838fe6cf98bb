"""A child process that must not outlive its parent (Linux's PR_SET_PDEATHSIG).

Torch-free, so an isolated engine's process (engines.isolated) can use it as well as the
bench workers.

    >>> die_with_parent(expected_parent)   # first thing in the child
"""

from __future__ import annotations

import os
import signal


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op elsewhere). With
    `parent_pid`, exit now if that parent is already gone (it died before the request)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
