"""Make the fake engine (tests/support/fake_engine.py) reachable from fresh processes.

`fake_engine_env(tmp)` writes a throwaway dist-info whose "kvtax.engines" entry point
names the fake, plus its "package" `kvtax_fake_backend` (left out with `installed=False`,
to play a missing install), and returns an environment for subprocesses that sees both.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: `tests` is a package in it
SRC = ROOT / "src"
BACKEND_VERSION = "1.2.3"


def fake_engine_env(tmp: Path, installed: bool = True) -> dict[str, str]:
    """Environment (os.environ + PYTHONPATH) in which `--engine fake` resolves."""
    site = Path(tmp) / "site"
    dist = site / "kvtax_fake_engine-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtax-fake-engine\n"
                                   "Version: 0\n")
    (dist / "entry_points.txt").write_text("[kvtax.engines]\nfake = tests.support.fake_engine\n")
    if installed:
        (site / "kvtax_fake_backend.py").write_text(f'VERSION = "{BACKEND_VERSION}"\n')
    path = [str(site), str(ROOT), str(SRC), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
