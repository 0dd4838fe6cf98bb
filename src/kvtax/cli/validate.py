"""Checks every command runs before any work starts (and argparse types that do them).

Each raises a KVTaxError (or argparse.ArgumentTypeError inside argparse) whose message
names the option, so the error boundary in `kvtax.cli.main` prints one line and exits 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvtax.errors import OptionError

LONG_CONTEXT_FLAG = "--allow-long-context"


def parse_contexts(text: str) -> list[int]:
    """"4k,16k,128k" or "4096,16384" → [4096, 16384, ...] (k = 1024)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            value = float(part[:-1] if mult > 1 else part) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"contexts are token counts like 512,4k,128k (k = 1024), not {text!r}"
            ) from None
        if value != int(value):
            raise argparse.ArgumentTypeError(f"context {part!r} is not a whole token count")
        out.append(int(value))
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"contexts must be positive integers, got {text!r}")
    return out


def at_least(low: int) -> Any:
    """An argparse type: an integer >= `low`."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n
    parse.__name__ = f"integer >= {low}"
    return parse


def size(text: str) -> int:
    """An argparse type: a size with a unit ("13.37GiB", "16GB", "512MiB", "4096B") → bytes."""
    from kvtax.harness.analysis.capacity import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_model(source: str) -> Any:
    """The ModelConfig of `source` (built-in name, HF folder, .gguf file, hub id), loaded
    without weights; a missing or unreadable model raises a KVTaxError naming it."""
    from kvtax.models import model_config

    return model_config(source)


def check_contexts(contexts: list[int], cfg: Any, allow_long: bool,
                   flag: str = LONG_CONTEXT_FLAG) -> None:
    """Refuse contexts past the model's trained maximum unless `allow_long` (its `flag`)."""
    limit = int(cfg.max_position_embeddings)
    over = [c for c in contexts if c > limit]
    if over and not allow_long:
        raise OptionError(
            f"context {max(over):,} is past {cfg.name}'s maximum of {limit:,} positions; "
            f"use smaller --contexts or pass {flag} to run past it"
        )


def check_formats(names: list[str], option: str = "--kv", allow: tuple[str, ...] = (),
                  hybrid: bool = False) -> None:
    """Parse every KV format name before a model loads or a table header prints (`hybrid`:
    sink/recent specs like int4+hk@s4r128 are valid too; `allow`: other accepted words)."""
    from kvtax.errors import FormatError
    from kvtax.formats import KVSpec
    from kvtax.formats.hybrid import parse_kv

    if not names:
        raise OptionError(f"{option} names no format")
    for name in names:
        if name in allow:
            continue
        try:
            (parse_kv if hybrid else KVSpec.parse)(name)
        except FormatError as exc:
            raise FormatError(f"{option} {name}: {exc}") from None


def check_arms(text: str | None, option: str = "--kv", allow: tuple[str, ...] = ()) -> list[str]:
    """The arms of `text` (comma-separated, `kvtax.harness.kv_arm` grammar), every format in
    them parsed before a model loads; FormatError (exit 2) names the bad arm (`allow`:
    other accepted words, e.g. "native"). Returns the arms as written, blanks dropped."""
    from kvtax.errors import FormatError
    from kvtax.harness.kv_arm import parse_arm

    names = [a.strip() for a in (text or "").split(",") if a.strip()]
    if not names:
        raise OptionError(f"{option} names no format")
    out = []
    for name in names:
        try:
            arm = parse_arm(name)
            if arm.base not in allow:
                arm.specs()
        except FormatError as exc:
            raise FormatError(f"{option} {name}: {exc}") from None
        out.append(arm.name)
    return out


def set_threads(threads: int | None) -> None:
    """torch intra-op threads for CPU work (None: leave torch's choice)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
