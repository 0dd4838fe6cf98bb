"""`kvtax` command line: one entry point, one module per subcommand.

Each module in COMMANDS exposes `register(subparsers)`, which adds its parser and sets
`func` (taking the parsed args, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvtax.errors import KVTaxError

COMMANDS = [
    "kvtax.cli.demo",
    "kvtax.cli.bench",
    "kvtax.cli.capacity",
    "kvtax.cli.roofline",
    "kvtax.cli.generate",
    "kvtax.cli.recall",
    "kvtax.cli.quality",
    "kvtax.cli.report",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtax",
        description="Quantized KV caches with fused attention, and the harness that "
        "measures whether they pay off.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except KVTaxError as exc:  # bad input kvtax itself refused: the message, no traceback
        print(f"kvtax {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
