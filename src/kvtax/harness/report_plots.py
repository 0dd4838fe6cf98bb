"""PNG figures for a run report (matplotlib, Agg backend; an optional dependency).

Each function takes the analysis dict (`analysis.summarize` plus the report's extras),
writes one PNG and returns its path, or None when there is nothing to draw.
`plotting_unavailable()` says why no figure can be drawn at all (matplotlib missing).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

GIB = 2**30


def plotting_unavailable() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install 'kvtax[report]'); figures skipped"
    return None


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _xs(per: Mapping[Any, Any]) -> list[int]:
    return sorted(int(c) for c in per)


def decode_plot(a: Mapping[str, Any], path: Path) -> Path | None:
    """ms/token vs context per arm: medians, rep spread, fitted lines, flagged points."""
    pts = a.get("decode_points", {})
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (arm, per) in enumerate(sorted(pts.items())):
        color = f"C{i % 10}"
        xs = _xs(per)
        ok = [c for c in xs if not per[c]["flagged"]]
        bad = [c for c in xs if per[c]["flagged"]]
        ax.plot(ok, [per[c]["median"] for c in ok], "o", color=color, label=arm)
        if bad:
            ax.plot(bad, [per[c]["median"] for c in bad], "x", color="red", ms=10, mew=2)
        fit = a.get("fits", {}).get(arm)
        if fit and xs:
            lo, hi = min(xs), max(xs)
            ax.plot([lo, hi], [fit["t0"] + fit["m"] * lo, fit["t0"] + fit["m"] * hi], "--",
                    color=color, lw=1)
    if any(p["flagged"] for per in pts.values() for p in per.values()):
        ax.plot([], [], "x", color="red", label="flagged (excluded from fit)")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms / token (median)")
    ax.set_title("Decode latency vs context; dashed: t0 + m * context")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def memory_plot(a: Mapping[str, Any], path: Path) -> Path | None:
    """Peak memory of each phase (and resident cache bytes) per arm vs context."""
    panels = [("prefill", a.get("peaks", {}).get("prefill", {})),
              ("decode", a.get("peaks", {}).get("decode", {})),
              ("resident cache", a.get("cache_bytes", {}))]
    panels = [(t, d) for t, d in panels if d]
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    arms = sorted({arm for _, d in panels for arm in d})
    for ax, (title, data) in zip(axes[0], panels):
        for arm in arms:
            per = data.get(arm)
            if not per:
                continue
            xs = _xs(per)
            ax.plot(xs, [per[c] / GIB for c in xs], "o-", color=f"C{arms.index(arm) % 10}",
                    label=arm, ms=4)
        ax.set_title(f"{title} peak" if title != "resident cache" else "resident cache bytes")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("GiB")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return _save(fig, path)


def ttft_plot(a: Mapping[str, Any], path: Path) -> Path | None:
    """Time to first token per arm vs context."""
    pts = a.get("ttft_points", {})
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (arm, per) in enumerate(sorted(pts.items())):
        xs = _xs(per)
        ax.plot(xs, [per[c]["median"] for c in xs], "o-", color=f"C{i % 10}", label=arm, ms=4)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("TTFT (s, median)")
    ax.set_title("Time to first token (prefill)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def recall_plot(grid: Mapping[str, Mapping[int, tuple[int, int]]], path: Path) -> Path | None:
    """Heat map of recall accuracy, arm x context, each cell annotated correct/total."""
    if not grid:
        return None
    plt = _plt()
    arms = list(grid)
    ctxs = sorted({int(c) for per in grid.values() for c in per})
    acc = [[(grid[a][c][0] / grid[a][c][1]) if c in grid[a] and grid[a][c][1] else float("nan")
            for c in ctxs] for a in arms]
    fig, ax = plt.subplots(figsize=(1.2 * len(ctxs) + 3, 0.5 * len(arms) + 1.8))
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, a in enumerate(arms):
        for j, c in enumerate(ctxs):
            if c in grid[a]:
                ax.text(j, i, f"{grid[a][c][0]}/{grid[a][c][1]}", ha="center", va="center",
                        fontsize=9)
    ax.set_xticks(range(len(ctxs)), [str(c) for c in ctxs])
    ax.set_yticks(range(len(arms)), arms)
    ax.set_xlabel("context (tokens)")
    ax.set_title("Planted-fact recall (correct/asked)")
    fig.colorbar(im, ax=ax, fraction=0.04)
    return _save(fig, path)


def compare_plot(table: list[dict[str, Any]], metric: str, path: Path) -> Path | None:
    """Ratio B/A of `metric` per arm vs context (1.0 = unchanged)."""
    rows = [r for r in table if r["metric"] == metric and r.get("ratio") is not None]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    arms = sorted({r["arm"] for r in rows})
    for i, arm in enumerate(arms):
        mine = sorted((r["context"], r["ratio"]) for r in rows if r["arm"] == arm)
        ax.plot([c for c, _ in mine], [v for _, v in mine], "o-", color=f"C{i % 10}", label=arm)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"{metric}: B / A")
    ax.set_title(f"Run B relative to run A: {metric}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
