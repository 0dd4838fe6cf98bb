"""PNG figures for a run report (matplotlib, Agg backend; an optional dependency).

Each function takes the analysis dict (`analysis.summarize` plus the report's extras, whose
`meta` names model, device and date for the titles), writes one PNG and returns its path, or
None when there is nothing to draw. Axes start at 0; bytes are drawn in the unit that fits
them; each arm keeps one color, marker and line style in every figure (the format picks the
marker, the path the line style), so overlapping lines stay apart.
`plotting_unavailable()` says why no figure can be drawn at all (matplotlib missing).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
STYLES = {"fused": "-", "fp16": "--", "unfused": ":", "dequant": "-."}
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


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


def byte_unit(values: Iterable[float]) -> tuple[str, float]:
    """The largest binary unit (GiB, MiB, KiB, B) not above the largest |value|."""
    top = max((abs(float(v)) for v in values), default=0.0)
    return next(((u, s) for u, s in UNITS if top >= s), ("B", 1))


def styler(arms: Iterable[str]) -> dict[str, dict[str, Any]]:
    """arm -> matplotlib kwargs (color by arm, marker by format, line style by path)."""
    arms = sorted(set(arms))
    kvs = sorted({a.split("/")[0] for a in arms})
    # Sizes alternate so a marker drawn on top of an identical value leaves the other's rim.
    return {a: {"color": f"C{i % 10}", "marker": MARKERS[kvs.index(a.split("/")[0])
                                                        % len(MARKERS)],
                "linestyle": STYLES.get(a.partition("/")[2], (0, (3, 1, 1, 1, 1, 1))),
                "ms": (9, 6, 4)[i % 3]}
            for i, a in enumerate(arms)}


def title(a: Mapping[str, Any], what: str) -> str:
    """`what` above a line with the run's model, device and date."""
    m = a.get("meta") or {}
    sub = " · ".join(str(m[k]) for k in ("model", "device", "date") if m.get(k))
    return f"{what}\n{sub}" if sub else what


def tokens_label(x: float, _pos: Any = None) -> str:
    """A token-count tick: 131072 -> "128k", 1536 -> "1.5k", 512 -> "512"."""
    return f"{x / 1024:g}k" if abs(x) >= 1024 else f"{x:g}"


def _finish(ax: Any, xlabel: str, ylabel: str, legend: bool = True) -> None:
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    ax.set_xlim(left=0)
    # Token counts are powers of two: ticks every 2^k tokens read 32k, 64k, 96k, 128k.
    step = 2 ** max(0, math.ceil(math.log2(max(ax.get_xlim()[1], 1) / 6)))
    ax.xaxis.set_major_locator(MultipleLocator(step))
    ax.xaxis.set_major_formatter(FuncFormatter(tokens_label))
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)


def decode_plot(a: Mapping[str, Any], path: Path) -> Path | None:
    """ms/token vs context per arm: medians, fitted lines (over each arm's measured
    contexts), the bytes-predicted line of each quantized arm (thin dotted: baseline slope x
    bytes ratio), flagged points. When some arm is far slower than the best fp16 (the
    baselines), a second panel shows only the arms within ZOOM x of it, on their own scale."""
    pts = a.get("decode_points", {})
    if not pts:
        return None
    plt = _plt()
    st = styler(pts)
    base = a.get("baseline")
    near = _near_baseline(pts, base)
    panels = [sorted(pts)] + ([near] if near and len(near) < len(pts) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(8 if len(panels) == 1 else 13, 5),
                             squeeze=False)
    for i, (ax, arms) in enumerate(zip(axes[0], panels)):
        _draw_decode(ax, a, arms, st)
        what = ("Decode ms/token vs context: points = medians, lines = fits" if i == 0 else
                f"zoom: arms within {ZOOM:g}x of {base}")
        ax.set_title(title(a, what), fontsize=10)
        _finish(ax, "context (tokens)", "decode ms / token")
    return _save(fig, path)


ZOOM = 3.0  # the zoom panel's arms: largest median within this factor of the baseline's


def _near_baseline(pts: Mapping[str, Any], base: str | None) -> list[str]:
    """Arms whose slowest median is within ZOOM x of the baseline's slowest (none: [])."""
    if base not in pts:
        return []
    top = max(p["median"] for p in pts[base].values())
    return sorted(arm for arm, per in pts.items()
                  if max(p["median"] for p in per.values()) <= ZOOM * top)


def _draw_decode(ax: Any, a: Mapping[str, Any], arms: list[str],
                 st: Mapping[str, Mapping[str, Any]]) -> None:
    pts, fits = a.get("decode_points", {}), a.get("fits", {})
    bpt, base = a.get("bytes_per_token", {}), a.get("baseline")
    for arm in arms:
        per = pts[arm]
        s, xs = st[arm], _xs(per)
        ok = [c for c in xs if not per[c]["flagged"]]
        ax.plot(ok, [per[c]["median"] for c in ok], s["marker"], color=s["color"], ms=s["ms"],
                mfc="none" if arm != base else s["color"])
        ax.plot([], [], color=s["color"], marker=s["marker"], linestyle=s["linestyle"],
                mfc="none", label=arm + (" (best fp16)" if arm == base else ""))
        bad = [c for c in xs if per[c]["flagged"]]
        if bad:  # the arm's own marker, faded, under a red cross: still whose it is
            ys = [per[c]["median"] for c in bad]
            ax.plot(bad, ys, s["marker"], color=s["color"], ms=s["ms"], alpha=0.4)
            ax.plot(bad, ys, "x", color="red", ms=5, mew=1.5)
        fit, top = fits.get(arm), max(xs)  # a fit is drawn only where the arm was measured
        if fit:
            ax.plot([0, top], [fit["t0"], fit["t0"] + fit["m"] * top], color=s["color"],
                    linestyle=s["linestyle"], lw=1.2)
        if fit and base in fits and arm != base and bpt.get(arm) and bpt.get(base):
            m = fits[base]["m"] * bpt[arm] / bpt[base]
            ax.plot([0, top], [fit["t0"], fit["t0"] + m * top], color=s["color"], lw=0.8,
                    linestyle=(0, (1, 2)), gid=f"predicted {arm}")
    if any(pts[arm][c]["flagged"] for arm in arms for c in pts[arm]):
        ax.plot([], [], "x", color="red", label="flagged (excluded from fit)")
    ax.plot([], [], color="grey", lw=0.8, linestyle=(0, (1, 2)),
            label=f"bytes-predicted slope ({base} slope x bytes ratio)")


def memory_plot(a: Mapping[str, Any], path: Path) -> Path | None:
    """Peak memory of each phase, and the cache's resident bytes (allocated, held), per arm
    vs context; each panel in its own unit."""
    kind = (a.get("meta") or {}).get("memory_kind")
    what = " (process RSS)" if kind == "cpu_rss" else ""
    panels = [(f"prefill peak{what}", a.get("peaks", {}).get("prefill", {})),
              (f"decode peak{what}", a.get("peaks", {}).get("decode", {})),
              ("resident cache (allocated)", a.get("cache_bytes", {}))]
    panels = [(t, d) for t, d in panels if d]
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 4.6), squeeze=False)
    st = styler(arm for _, d in panels for arm in d)
    for ax, (name, data) in zip(axes[0], panels):
        unit, scale = byte_unit(v for per in data.values() for v in per.values())
        for arm, per in sorted(data.items()):
            xs, s = _xs(per), st[arm]
            ax.plot(xs, [per[c] / scale for c in xs], color=s["color"], marker=s["marker"],
                    linestyle=s["linestyle"], mfc="none", ms=s["ms"], label=arm)
        ax.set_title(name, fontsize=10)
        _finish(ax, "context (tokens)", unit, legend=ax is axes[0][0])
    fig.suptitle(title(a, "Memory per phase vs context"), fontsize=10)
    return _save(fig, path)


def ttft_plot(a: Mapping[str, Any], path: Path) -> Path | None:
    """Time to first token per arm vs context."""
    pts = a.get("ttft_points", {})
    if not pts:
        return None
    plt = _plt()
    st = styler(pts)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for arm, per in sorted(pts.items()):
        xs, s = _xs(per), st[arm]
        ax.plot(xs, [per[c]["median"] for c in xs], color=s["color"], marker=s["marker"],
                linestyle=s["linestyle"], mfc="none", ms=s["ms"], label=arm)
    ax.set_title(title(a, "Time to first token (prefill) vs context"), fontsize=10)
    _finish(ax, "context (tokens)", "TTFT (s, median)")
    return _save(fig, path)


def break_even_plot(v: Mapping[str, Any], a: Mapping[str, Any], path: Path) -> Path | None:
    """Time to answer (TTFT + n x ms/token) vs generated tokens n at the largest context
    with TTFT for the best fp16 arm; a quantized line crossing below it is its break-even."""
    from kvtax.harness.analysis.verdict import finish_s

    base = v.get("baseline")
    tt = a.get("ttft_points", {})
    if not base or base not in tt:
        return None
    ctx = max(tt[base])
    arms = [arm for arm in sorted(tt) if ctx in tt[arm]]
    bes = [r["break_even"] for r in v.get("formats", [])
           if r["at"] == ctx and isinstance(r["break_even"], int)]
    top = max([4096, *[2 * b for b in bes]])
    ns = [round(top * i / 40) for i in range(41)]
    plt = _plt()
    st = styler(arms)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for arm in arms:
        ys = [finish_s(a, arm, ctx, n) for n in ns]
        s = st[arm]
        ax.plot(ns, ys, color=s["color"], linestyle=s["linestyle"], marker=s["marker"],
                markevery=8, mfc="none", ms=s["ms"], lw=2.2 if arm == base else 1.2,
                label=arm + (" (best fp16)" if arm == base else ""))
    ax.set_title(title(a, f"Time to answer a {ctx:,}-token prompt vs tokens generated"),
                 fontsize=10)
    _finish(ax, "generated tokens", "TTFT + tokens x decode (s)")
    return _save(fig, path)


def recall_plot(grid: Mapping[str, Mapping[int, tuple[int, int]]], path: Path,
                a: Mapping[str, Any] | None = None) -> Path | None:
    """Heat map of recall accuracy, arm x context, each cell annotated correct/total."""
    if not grid:
        return None
    plt = _plt()
    arms = list(grid)
    ctxs = sorted({int(c) for per in grid.values() for c in per})
    acc = [[(grid[a][c][0] / grid[a][c][1]) if c in grid[a] and grid[a][c][1] else float("nan")
            for c in ctxs] for a in arms]
    fig, ax = plt.subplots(figsize=(1.2 * len(ctxs) + 3, 0.5 * len(arms) + 2.0))
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, arm in enumerate(arms):
        for j, c in enumerate(ctxs):
            if c in grid[arm]:
                ax.text(j, i, f"{grid[arm][c][0]}/{grid[arm][c][1]}", ha="center",
                        va="center", fontsize=9)
    ax.set_xticks(range(len(ctxs)), [str(c) for c in ctxs])
    ax.set_yticks(range(len(arms)), arms)
    ax.set_xlabel("context (tokens)")
    ax.set_title(title(a or {}, "Planted-fact recall (correct/asked)"), fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.04)
    return _save(fig, path)


def compare_plot(table: list[dict[str, Any]], metric: str, path: Path,
                 names: tuple[str, str] = ("A", "B")) -> Path | None:
    """Ratio B/A of `metric` per arm vs context (1.0 = unchanged), same look as the run's."""
    rows = [r for r in table if r["metric"] == metric and r.get("ratio") is not None]
    if not rows:
        return None
    plt = _plt()
    st = styler(r["arm"] for r in rows)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for arm in sorted(st):
        mine = sorted((r["context"], r["ratio"]) for r in rows if r["arm"] == arm)
        s = st[arm]
        ax.plot([c for c, _ in mine], [v for _, v in mine], color=s["color"],
                marker=s["marker"], linestyle=s["linestyle"], mfc="none", ms=s["ms"], label=arm)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_title(f"{metric}: B / A (1 = unchanged)\nA = {names[0]} · B = {names[1]}",
                 fontsize=10)
    _finish(ax, "context (tokens)", f"{metric}: B / A")
    return _save(fig, path)
