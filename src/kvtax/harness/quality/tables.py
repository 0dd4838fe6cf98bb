"""Quality tables (kind "quality" rows) for report.md and the terminal.

    >>> lines = section_quality(read_rows(run_dir))   # markdown lines, [] without quality rows
    >>> print(quality_text_table(read_rows(run_dir)))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Row = Mapping[str, Any]


def quality_rows(rows: Sequence[Row]) -> list[Row]:
    """Successful quality rows, last one per cell (a resumed run may repeat none)."""
    by_cell: dict[str, Row] = {}
    for r in rows:
        if r.get("kind") == "quality" and r.get("status") == "ok":
            by_cell[str(r.get("cell_id"))] = r
    return list(by_cell.values())


def _fmt(x: Any, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _worst(r: Row) -> str:
    errs = [(e, i) for i, e in enumerate(r.get("layer_attn_rel_err") or []) if e is not None]
    if not errs:
        return "-"
    e, i = max(errs)
    return f"{e:.3g} (L{i})"


def _main_rows(rs: Sequence[Row]) -> list[list[str]]:
    out = []
    for r in sorted(rs, key=lambda r: (str(r.get("model")), int(r["context"]), int(r["seq"]))):
        kl = f"{r['kl']:.3g} ± {r.get('kl_sem') or 0:.1g}" if r.get("kl") else "0"
        out.append([
            str(r["kv"]), str(r["context"]), kl, _fmt(r.get("kl_max")),
            _fmt(r.get("top1"), ".3f"), _fmt(r.get("ppl"), ".4g"),
            _fmt(r.get("ppl_delta"), "+.3g"), _fmt(r.get("ppl_full_delta"), "+.3g"),
            _worst(r), _fmt((r.get("cache_bytes") or 0) / 2**20, ".2f"),
        ])
    return out


HEAD = ["format", "context", "KL mean ± s.e.", "KL max", "top-1", "ppl", "Δppl",
        "Δppl (all pos.)", "worst layer attn err", "cache MiB"]


def _md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def section_quality(rows: Sequence[Row]) -> list[str]:
    """Markdown: the quality table per model and the per-layer attention error table."""
    rs = quality_rows(rows)
    if not rs:
        return []
    tail = rs[0].get("tail")
    base = rs[0].get("baseline", "fp16")
    out = ["## Quality: quantized KV against the fp16-KV run", "",
           f"Teacher-forced over the last {tail} positions of each context: mean "
           f"KL({base} || format) in nats with its standard error, the largest per-position "
           f"KL, top-1 agreement with the {base} run, perplexity of the text's next tokens "
           f"and its delta against {base} (also over every position of the context), and the "
           "largest per-layer relative attention-output error (same q, the run's own K/V, "
           "read from the format vs from an fp16 copy).", ""]
    for model in sorted({str(r.get("model")) for r in rs}):
        mine = [r for r in rs if str(r.get("model")) == model]
        out += [f"### {model}", ""]
        out += _md_table(HEAD, _main_rows(mine))
        out += _layer_section(mine)
    return out


def _layer_section(rs: Sequence[Row]) -> list[str]:
    ctx = max(int(r["context"]) for r in rs)
    at = [r for r in sorted(rs, key=lambda r: int(r["seq"]))
          if int(r["context"]) == ctx and r.get("layer_attn_rel_err")]
    if not at:
        return []
    windows = at[0].get("layer_windows") or []
    n = max(len(r["layer_attn_rel_err"]) for r in at)
    out = [f"Per-layer relative attention error at context {ctx} (global = full attention, "
           "wN = sliding window of N):", ""]
    rows = []
    for i in range(n):
        w = windows[i] if i < len(windows) else None
        kind = "global" if w is None else f"w{w}"
        rows.append([str(i), kind] + [_fmt(r["layer_attn_rel_err"][i]) for r in at])
    return out + _md_table(["layer", "attn", *[str(r["kv"]) for r in at]], rows)


def quality_text_table(rows: Sequence[Row]) -> str:
    """The main quality table as aligned plain text (what `kvtax quality` prints)."""
    rs = quality_rows(rows)
    if not rs:
        return "no quality rows completed"
    body = _main_rows(rs)
    table = [HEAD, *body]
    widths = [max(len(str(r[i])) for r in table) for i in range(len(HEAD))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in table)
