"""Option groups that several commands share (so their spelling and defaults agree)."""

from __future__ import annotations

import argparse


def add_model_dtype(p: argparse.ArgumentParser, cuda_default: str = "bfloat16",
                    why: str = "") -> None:
    """--device, --dtype: where the model runs and in what precision (`cuda_default`: the
    dtype on CUDA when --dtype is not given; `why` is appended to the help)."""
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    where = ("" if cuda_default == "float32"
             else f" on CPU, {cuda_default} on CUDA")
    p.add_argument("--dtype", default=None,
                   help=f"model dtype: float32, bfloat16, float16 (default float32{where}{why})")


def add_run_folder(p: argparse.ArgumentParser, name: str, unit: str) -> None:
    """--out, --name, --resume, --no-report: the run folder a command writes its rows to;
    `name` is the folder suffix, `unit` what one row is ("cells", "questions")."""
    p.add_argument("--out", default="runs", help="folder that receives the run folder "
                   "(default runs)")
    p.add_argument("--name", default=name, help=f"run folder name suffix (default {name})")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help=f"continue a run folder: {unit} with a row are skipped")
    p.add_argument("--no-report", action="store_true", help="skip report.md at the end")


def add_threads(p: argparse.ArgumentParser, default: str = "torch's choice: all cores") -> None:
    """--threads: torch intra-op threads for this command's CPU work."""
    from kvtax.cli.validate import at_least

    p.add_argument("--threads", type=at_least(1), default=None,
                   help=f"torch CPU threads (default {default}; on a shared machine a pool "
                        "of all cores adds more noise than speed)")


def add_allow_long(p: argparse.ArgumentParser) -> None:
    """--allow-long-context: run contexts past the model's trained maximum positions."""
    p.add_argument("--allow-long-context", action="store_true",
                   help="run contexts past the model's maximum positions (refused otherwise)")
