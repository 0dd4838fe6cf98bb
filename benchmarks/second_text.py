"""Write the held-out text for KV quality checks: prose no format was tuned on.

`kvtax quality` scores the prose of CPython's pydoc_data/topics.py by default, and kvtax's
4-bit design was chosen on it (docs/QUALITY.md, the scheme screen). A claim of quality then
needs a second text of another kind, fixed before tuning and never tuned on. This one is
what every CPython installation carries besides that: IDLE's help page (tags stripped), its
change logs, notes and README, and CPython's LICENSE, concatenated in the order of PARTS.
Chosen on 2026-12-02, before any q4 configuration was measured on it. The files differ
between Python versions, so the text of record is this script's output under CPython
3.11.7, committed as benchmarks/data/held_out_text.txt (~230 KB, ~60k Qwen2.5 tokens).

    python benchmarks/second_text.py benchmarks/data/held_out_text.txt
    kvtax quality --text benchmarks/data/held_out_text.txt --kv q4,q8 ...
"""

from __future__ import annotations

import html
import re
import sys
import sysconfig
from pathlib import Path

PARTS = ("idlelib/help.html", "idlelib/NEWS.txt", "idlelib/ChangeLog", "idlelib/NEWS2x.txt",
         "idlelib/README.txt", "idlelib/HISTORY.txt", "idlelib/TODO.txt", "idlelib/extend.txt",
         "idlelib/CREDITS.txt", "LICENSE.txt")


def strip_html(text: str) -> str:
    """Visible text of an HTML page: no head/script/style, tags removed, entities decoded,
    runs of blank lines collapsed."""
    text = re.sub(r"(?is)<(head|script|style)\b.*?</\1>", " ", text)
    text = re.sub(r"(?s)<[^>]+>", "", text)
    text = html.unescape(text)
    return re.sub(r"\n\s*\n+", "\n\n", text).strip()


def second_text(stdlib: Path | None = None) -> str:
    """The held-out text (see the module docstring) from `stdlib` (default: this Python's)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    chunks = []
    for part in PARTS:
        raw = (root / part).read_text(encoding="utf-8", errors="replace")
        chunks.append(strip_html(raw) if part.endswith(".html") else raw.strip())
    return "\n\n".join(chunks) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python benchmarks/second_text.py OUT.txt", file=sys.stderr)
        return 2
    out = Path(args[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    text = second_text()
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}: {len(text):,} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
