"""Play a missing engine package in a fresh process: `hidden_env(tmp, ["mlx_lm"])`.

Writes a `sitecustomize.py` that makes Python's path finder report the named top-level
modules as absent (`importlib.util.find_spec` gives None, `import` fails), and returns an
environment for subprocesses that loads it before anything else.
"""

from __future__ import annotations

import os
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

_SITE = '''import importlib.machinery as _m

_HIDDEN = {hidden!r}
_find = _m.PathFinder.find_spec


def _find_spec(fullname, path=None, target=None):
    if fullname.split(".")[0] in _HIDDEN:
        return None
    return _find(fullname, path, target)


_m.PathFinder.find_spec = _find_spec
'''


def hidden_env(tmp: Path, modules: list[str]) -> dict[str, str]:
    """os.environ with `modules` unimportable (and this tree's kvtax first on the path)."""
    site = Path(tmp) / "hide"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE.format(hidden=sorted(modules)))
    path = [str(site), str(SRC), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
