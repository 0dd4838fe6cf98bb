"""Run folders: `runs/<UTC timestamp>-<name>/` holding config.json, env.json, rows.jsonl.

A folder is never overwritten: a name collision gets a numeric suffix. Each row is
appended, flushed and fsynced before the next cell starts, so a crash or SIGKILL loses at
most the cell in flight. Reading tolerates a torn last line (the process died mid-write),
and reopening for append cuts that torn tail off first so the next row starts clean.

    >>> run = RunStore.create("runs", "sweep", config)
    >>> run.append(row)
    >>> RunStore.open(run.path).done_cell_ids()
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from kvtax.errors import KVTaxError
from kvtax.harness.bench import devinfo

CONFIG = "config.json"
ENV = "env.json"
ROWS = "rows.jsonl"
# Version of the run folder's layout, stored as config.json's "run_schema". Folders written
# before it existed carry "kind" and their sweep fields, which is enough to resume them.
RUN_SCHEMA = 1


class RunFolderError(KVTaxError, ValueError):
    """A folder that cannot be resumed: not a run folder, or a run of another kind/schema."""


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _finite(obj: Any) -> Any:
    """NaN/inf become null: JSON has no spelling for them and readers would choke."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of a rows.jsonl file (or a run folder); a torn or garbled line is skipped."""
    p = Path(path)
    if p.is_dir():
        p = p / ROWS
    if not p.exists():
        return []
    rows = []
    with open(p, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # the torn tail of a killed writer
            if isinstance(obj, dict):
                rows.append(obj)
    return rows


def _cut_torn_tail(path: Path) -> int:
    """Truncate bytes after the last newline; return how many were cut."""
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return 0
        # Scan backwards for the last complete line.
        pos, chunk = size, 4096
        keep = 0
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            buf = f.read(pos - start)
            idx = buf.rfind(b"\n")
            if idx >= 0:
                keep = start + idx + 1
                break
            pos = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
        return size - keep


class RunStore:
    """One run folder. Create a new one with `create`, reopen one with `open`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.rows_path = self.path / ROWS

    @property
    def run_id(self) -> str:
        return self.path.name

    @classmethod
    def create(
        cls, root: str | os.PathLike[str], name: str, config: Mapping[str, Any]
    ) -> "RunStore":
        """Make a fresh folder `root/<YYYYmmddTHHMMSSZ>-<name>` (suffix -2, -3… on collision)."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "run"
        base = root / f"{stamp}-{safe}"
        path, n = base, 1
        while True:
            try:
                path.mkdir()  # atomic: never reuse an existing folder
                break
            except FileExistsError:
                n += 1
                path = base.with_name(f"{base.name}-{n}")
        store = cls(path)
        _write_json(path / CONFIG, dict(config, run_id=store.run_id, run_schema=RUN_SCHEMA))
        store.rows_path.touch()
        return store

    @classmethod
    def open(cls, path: str | os.PathLike[str], kind: str | None = None,
             required: tuple[str, ...] = ()) -> "RunStore":
        """Reopen an existing run folder (for --resume); cuts a torn last line.

        With `kind` ("bench", "recall", "quality", "roofline") the config must be a run of
        that kind, of a schema this version writes, holding every key in `required`;
        anything else raises RunFolderError saying why (never resumed with defaults).
        """
        store = cls(path)
        if not store.path.is_dir():
            raise RunFolderError(f"{store.path} does not exist; pass a run folder that a "
                                 "previous run printed")
        if not (store.path / CONFIG).exists():
            raise RunFolderError(
                f"{store.path} is not a run folder (no {CONFIG}); pass the folder a "
                "previous run printed"
            )
        if kind is not None:
            store._check_config(kind, required)
        _cut_torn_tail(store.rows_path)
        return store

    def _check_config(self, kind: str, required: tuple[str, ...]) -> None:
        try:
            cfg = self.config()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RunFolderError(f"{self.path / CONFIG} is not valid JSON ({exc})") from None
        if not isinstance(cfg, dict) or not cfg:
            raise RunFolderError(f"{self.path / CONFIG} is empty; not a kvtax {kind} run")
        found = cfg.get("kind")
        if not found:
            raise RunFolderError(f"{self.path / CONFIG} names no run kind; not a kvtax {kind} "
                                 "run, so it cannot be resumed as one")
        if found != kind:
            raise RunFolderError(f"{self.path} is a kvtax {found} run, not a {kind} run; "
                                 f"resume it with `kvtax {found} --resume {self.path}`")
        schema = cfg.get("run_schema", RUN_SCHEMA)
        if not isinstance(schema, int) or schema > RUN_SCHEMA:
            raise RunFolderError(f"{self.path} has run schema {schema!r}; this kvtax reads "
                                 f"up to {RUN_SCHEMA} (upgrade kvtax to resume it)")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise RunFolderError(f"{self.path / CONFIG} lacks {', '.join(missing)}; it does "
                                 f"not say what the {kind} run was, so it cannot be resumed")

    def config(self) -> dict[str, Any]:
        return json.loads((self.path / CONFIG).read_text())

    def write_env(self, env: Mapping[str, Any]) -> None:
        """env.json; on resume earlier environments are kept under `previous`."""
        p = self.path / ENV
        env = dict(env)
        if p.exists():
            old = json.loads(p.read_text())
            env["previous"] = old.get("previous", []) + [
                {k: v for k, v in old.items() if k != "previous"}
            ]
        _write_json(p, env)

    def update_env(self, extra: Mapping[str, Any]) -> None:
        """Add keys to env.json: facts a run learns once under way (the text it scored)."""
        p = self.path / ENV
        _write_json(p, {**(json.loads(p.read_text()) if p.exists() else {}), **extra})

    def append(self, row: Mapping[str, Any]) -> None:
        """Append one row and fsync it before returning."""
        line = json.dumps(_finite(row), sort_keys=True, default=str, allow_nan=False) + "\n"
        with open(self.rows_path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.rows_path)

    def done_cell_ids(self) -> set[str]:
        """Cells that have a row (any status): resume skips these."""
        return {r["cell_id"] for r in self.rows() if "cell_id" in r}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows())


def git_commit(cwd: str | os.PathLike[str] | None = None) -> str | None:
    """HEAD of the repository holding kvtax (with `+dirty` if uncommitted), or None."""
    here = Path(cwd) if cwd else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=10,
        )
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict[str, Any]:
    """What env.json records: device, driver, CUDA, library versions, git commit, host."""
    import torch

    env: dict[str, Any] = {
        "device": devinfo.device_name(device),
        "device_type": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "kvtax": _version("kvtax"),
        "numpy": _version("numpy"),
        "git_commit": git_commit(),
        "argv": sys.argv,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch_threads": torch.get_num_threads(),
    }
    env.update(devinfo.host_info())
    env.update(devinfo.gpu_info(device))
    return env
