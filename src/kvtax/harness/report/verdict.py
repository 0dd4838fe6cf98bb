"""The report's opening: the verdict in plain sentences, its table, and the advice grid.

    >>> lines = section_verdict(verdict(analysis, env, weight_bytes=w))
    >>> lines[2]
    '**On AMD EPYC with tiny, quantized KV does not pay off for speed: ...**'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtax.harness.analysis import stats
from kvtax.harness.report.markdown import num, size, table

WHAT_N = {64: "a short answer", 512: "a paragraph", 4096: "a long generation"}


def _ctx_list(ctxs: Sequence[int]) -> str:
    return ", ".join(f"{c:,}" for c in ctxs)


def _lead(v: Mapping[str, Any]) -> str:
    """The first sentence: whether quantized KV pays off here, and where."""
    where = f"On {v['device']} with {v['model']}"
    base, grid = v["baseline"], v["advice"]
    ctxs = sorted(grid)
    span = "-" if not ctxs else f"{ctxs[0]:,}" + (f"-{ctxs[-1]:,}" if len(ctxs) > 1 else "")
    if not v["formats"]:
        return (f"{where}, no quantized format was measured: this run holds only unquantized "
                f"arms (the best is {base}), so it cannot say whether quantized KV pays off.")
    if not v["pays_off"]:
        return (f"{where}, quantized KV does not pay off for speed: no quantized format "
                f"both decodes faster than the best fp16 arm ({base}) and finishes first, at "
                f"any context measured ({span} tokens), for "
                f"{', '.join(str(n) for n in sorted({n for per in grid.values() for n in per}))}"
                " generated tokens.")
    ctx, n, arm = min(v["quantized_wins"])
    row = next((r for r in v["formats"] if r["arm"] == arm), {})
    total = sum(len(p) for p in grid.values())
    return (f"{where}, quantized KV pays off for speed in {len(v['quantized_wins'])} of "
            f"{total} cases (context x generated tokens): from {ctx:,}-token prompts with "
            f"{n:,} generated tokens, where {arm} finishes first"
            + (f"; at {row['at']:,} tokens it decodes {num(row['decode_speedup'])}x as fast as "
               f"the best fp16 arm ({base})." if row.get("decode_speedup") else "."))


def sentences(v: Mapping[str, Any]) -> list[str]:
    """The verdict in a few plain sentences, the answer first."""
    out = [_lead(v)]
    base = v["baseline"]
    rows = v["formats"]
    ratios = [r for r in rows if r.get("slope_ratio") and r.get("predicted")]
    fused = [r for r in ratios if r["arm"].endswith("/fused")] or ratios
    if fused:
        out.append(f"Decode slope ratios against {base} (its ms per context token / the "
                   "format's): " + ", ".join(
                       f"{r['arm']} {num(r['slope_ratio'])} (bytes predict "
                       f"{num(r['predicted'])})" for r in fused[:4]) + ".")
    late = [r for r in rows if r["faster_from"] is not None]
    if late and not v["pays_off"]:
        out.append("Decode alone is faster for " + ", ".join(
            f"{r['arm']} from {r['faster_from']:,} tokens" for r in late[:4])
            + ", but the prefill penalty is not paid back within the answer lengths above.")
    if v.get("noisy_points"):
        out.append(f"Caution: {v['noisy_points']} of {v['points']} measured points are noisy "
                   f"(robust CV above {v.get('cv_threshold')}) and left out of the fits; "
                   "more --reps on an idle machine make this verdict firmer.")
    if v["memory_bytes"] is not None:
        seen: dict[str, dict[str, Any]] = {}
        for r in rows:
            seen.setdefault(r["arm"].split("/")[0], r)
        fit = [f"{kv} {num(r['tokens_fit'])} ({num(r['tokens_fit_ratio'])}x)"
               for kv, r in seen.items() if r.get("tokens_fit")]
        if fit:
            out.append(f"Memory: {size(v['memory_bytes'])} ({v['memory_source']}) minus "
                       f"{size(v['weight_bytes'] or 0)} of weights holds this many tokens "
                       f"of KV cache (x {base}'s): " + ", ".join(fit) + ".")
    else:
        out.append(f"Capacity is not computed: {v['memory_source']}.")
    return out


def _be(x: Any) -> str:
    return "never" if x == stats.NEVER else num(x)


def _quality(r: Mapping[str, Any]) -> tuple[str, str]:
    kl = f"{num(r['kl'])} @ {r['kl_context']:,}" if r.get("kl") is not None else "-"
    rec = f"{r['recall'][0]}/{r['recall'][1]}" if r.get("recall") else "-"
    return kl, rec


def verdict_table(v: Mapping[str, Any]) -> list[str]:
    """One row per quantized arm, every number against the best fp16 arm."""
    rows = []
    for r in v["formats"]:
        kl, rec = _quality(r)
        at = "-" if r["at"] is None else f"{r['at']:,}"
        rows.append([
            r["arm"], "never" if r["faster_from"] is None else f"{r['faster_from']:,}",
            f"{num(r['decode_speedup'])}x @ {at}" if r["decode_speedup"] else "-",
            f"{num(r['prefill_penalty'])}x" if r["prefill_penalty"] else "-",
            _be(r["break_even"]), f"{num(r['slope_ratio'])} ({num(r['predicted'])})",
            "-" if r["tokens_fit"] is None else
            f"{num(r['tokens_fit'])} ({num(r['tokens_fit_ratio'])}x)", kl, rec,
        ])
    return table(["format", "decode faster from (ctx)", "decode speedup",
                  "prefill penalty", "break-even tokens", "slope ratio (bytes predict)",
                  "tokens in memory (vs fp16)", "KL (nats) @ ctx", "recall"], rows)


def _advice_line(v: Mapping[str, Any], n: int) -> str:
    grid = v["advice"]
    wins = sorted((ctx, arm) for ctx, nn, arm in v["quantized_wins"] if nn == n)
    what = f"- **{n:,} generated tokens** ({WHAT_N.get(n, 'an answer')}): "
    if not wins:
        return what + "keep fp16 KV at every context measured."
    ctxs = sorted(grid)
    if [c for c, _ in wins] == [c for c in ctxs if c >= wins[0][0]]:
        arms = sorted({a for _, a in wins})
        return what + (f"quantize from {wins[0][0]:,} tokens ({', '.join(arms)}); keep fp16 "
                       "below." if wins[0][0] > ctxs[0] else
                       f"quantize at every context measured ({', '.join(arms)}).")
    return what + "quantize at " + ", ".join(f"{c:,} ({a})" for c, a in wins) + \
        "; keep fp16 elsewhere."


def advice_table(v: Mapping[str, Any]) -> list[str]:
    """context x answer length: who finishes first, its seconds, the best fp16's."""
    grid, base = v["advice"], v["baseline"]
    ns = sorted({n for per in grid.values() for n in per})
    counted = {(ctx, n) for ctx, n, _arm in v.get("quantized_wins", [])}
    rows = []
    for ctx, per in sorted(grid.items()):
        cells = []
        for n in ns:
            cell = per.get(n) or {}
            win, secs = cell.get("winner"), cell.get("seconds", {})
            if win is None:
                cells.append("-")
                continue
            ref = secs.get(base)
            tail = "" if win == base or ref is None else f" vs {num(ref)} s"
            star = " *" if cell.get("noisy") else ""
            if win != base and not star and (ctx, n) not in counted:
                star = " †"  # first by the fits, but its measured decode is not faster there
            cells.append(f"{win} {num(secs[win])} s{tail}{star}")
        misfit = sorted({a for cell in per.values() for a in cell.get("misfit", [])})
        rows.append([f"{ctx:,}", *cells, ", ".join(misfit) or "-"])
    out = table(["context", *[f"{n:,} tokens" for n in ns], "does not fit in memory"], rows)
    if any("*" in str(c) for r in rows for c in r):
        out += ["`*`: the winner's TTFT or decode point there is flagged noisy; the verdict "
                "does not count it.", ""]
    if any("†" in str(c) for r in rows for c in r):
        out += ["`†`: first by the fitted lines, but its measured decode at this context is not "
                "faster than every fp16 arm's, so the advice above keeps fp16 there (the "
                "margin is inside what the fits can tell apart).", ""]
    return out


def section_verdict(v: Mapping[str, Any] | None, figs: Mapping[str, str] | None = None
                    ) -> list[str]:
    """Markdown: the verdict sentences, its table, the computed practical advice and the
    break-even figure."""
    if not v or not v.get("baseline"):
        return []
    out = ["## Verdict", ""]
    say = sentences(v)
    out += [f"**{say[0]}**", ""]
    if len(say) > 1:
        out += [" ".join(say[1:]), ""]
    out += [f"Best fp16 arm: **{v['baseline']}**, {v.get('baseline_rule') or ''}. Speedup, "
            "penalty and break-even are at the largest context both arms measured; "
            "tokens in memory = (device memory - weights) / bytes per token.", ""]
    out += verdict_table(v)
    out += ["### Which finishes first", "",
            "Time to answer = TTFT + n x decode ms/token (decode from the arm's fitted line at "
            "the answer's mean context, prompt + n/2), among the arms whose measured peak plus "
            "n tokens of KV fit in memory. The shape of the advice follows a published "
            "measurement of Qwen3-8B-4bit on an M5 Pro with mlx-lm (long context and a short "
            "answer: keep fp16; long generation: quantize; under ~32k: do not quantize for "
            "speed); here it is computed from this run:", ""]
    out += [_advice_line(v, n) for n in sorted({n for p in v["advice"].values() for n in p})]
    out += [""] + advice_table(v)
    if figs and "break_even" in figs:
        out += [f"![time to answer vs generated tokens]({figs['break_even']})", ""]
    return out
