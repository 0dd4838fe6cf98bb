"""`kvtax` command line: one entry point, one module per subcommand.

Each module in COMMANDS exposes `register(subparsers)`, which adds its parser and sets
`func` (taking the parsed args, returning an exit code; see `kvtax.cli.outcome`). `main`
is the one error boundary: kvtax errors, bad options and OS errors become one line on
stderr and exit 2; anything else one line and exit 4; `kvtax --debug CMD` adds tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from kvtax.cli.outcome import BAD_INPUT, EPILOG, INTERRUPTED, UNEXPECTED
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


def version() -> str:
    """The installed distribution's version, else the source tree's `kvtax.__version__`."""
    from importlib import metadata

    try:
        return metadata.version("kvtax")
    except metadata.PackageNotFoundError:
        import kvtax

        return kvtax.__version__


class _Parser(argparse.ArgumentParser):
    """argparse with its error as one line (the usage is one --help away), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvtax",
        description="Quantized KV caches with fused attention, and the harness that "
        "measures whether they pay off.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvtax {version()}")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of any error (kvtax --debug CMD ...)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    for p in sub.choices.values():  # one exit-status text for every command's --help
        p.epilog = f"{p.epilog}\n\n{EPILOG}" if p.epilog else EPILOG
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="print the traceback of any error")
    return parser


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Run one `kvtax` command line; returns its exit status (see --help's epilog)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # bad options: argparse prints usage and exits 2
    if not getattr(args, "func", None):
        parser.print_help()
        return BAD_INPUT
    prog = f"kvtax {args.command}"
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (KVTaxError, OSError, argparse.ArgumentTypeError) as exc:
        # Bad input or an environment problem the message explains: no traceback.
        if args.debug:
            traceback.print_exc()
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return BAD_INPUT
    except Exception as exc:  # a bug: one line unless asked for more
        if args.debug:
            traceback.print_exc()
        hint = "" if args.debug else " (run with --debug for the traceback)"
        print(f"{prog}: unexpected error: {type(exc).__name__}: {_one_line(exc)}{hint}",
              file=sys.stderr)
        return UNEXPECTED


if __name__ == "__main__":
    raise SystemExit(main())
