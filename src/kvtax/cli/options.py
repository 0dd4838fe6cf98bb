"""Option groups that several commands share (so their spelling and defaults agree)."""

from __future__ import annotations

import argparse
import json
from typing import Any


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


def add_engine(p: argparse.ArgumentParser, default: str = "kvtax", extra: str = "") -> None:
    """--engine, --url, --engine-option: which stack runs the work and its settings
    (read back with `engine_options`); `extra` is appended to --engine's help."""
    p.add_argument("--engine", default=default,
                   help="stack that runs the model: kvtax, transformers, llama.cpp, mlx-lm, "
                        f"openai (default {default}{extra})")
    p.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                   help="openai: one arm per server, e.g. --url q8=http://127.0.0.1:8000 "
                        "(repeat; restart the server between arms yourself)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine-specific setting (repeat; VALUE is read as JSON when it "
                        "parses, else as text)")


def pairs(items: list[str], flag: str) -> dict[str, str]:
    """["a=1", "b=x"] → {"a": "1", "b": "x"}; ArgumentTypeError on a missing "="."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise argparse.ArgumentTypeError(f"{flag} wants NAME=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """--engine-option KEY=VALUE pairs (JSON values where they parse) and --url NAME=URL
    servers (as options["urls"]) of `add_engine`."""
    out: dict[str, Any] = {}
    for key, value in pairs(args.engine_option, "--engine-option").items():
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    if args.url:
        out["urls"] = pairs(args.url, "--url")
    return out
