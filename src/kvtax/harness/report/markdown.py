"""Markdown sections of a run report, from `report.data.gather`'s dict.

Each `section_*` returns a list of lines (empty when the run has nothing for it), so the
report reads top-down: what ran, the verdict, what the arms are, decode and its fits, noisy cells, prefill and break-even,
memory per phase, cost, recall, roofline, failures, claims, environment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvtax.harness.analysis.capacity import format_size
from kvtax.harness.schema import PATH_MEANING


def num(x: Any, digits: int = 3) -> str:
    """A number with `digits` significant digits; '-' for missing; strings pass through."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    x = float(x)
    if math.isnan(x) or math.isinf(x):
        return "-" if math.isnan(x) else str(x)
    x = float(f"{x:.{digits}g}")  # round first, so 9.9996 prints as 10.0, not 10.00
    if x == 0:
        return "0"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:.{max(0, digits - 1 - int(math.floor(math.log10(abs(x)))))}f}"


def size(x: Any) -> str:
    return "-" if x is None else format_size(float(x))


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table; cells are str()-ed and pipes escaped."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(cell(h) for h in header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return out + [""]


def _contexts(per_arm: Mapping[str, Mapping[Any, Any]]) -> list[int]:
    return sorted({int(c) for per in per_arm.values() for c in per})


def _fig(figs: Mapping[str, str], key: str, caption: str) -> list[str]:
    return [f"![{caption}]({figs[key]})", ""] if key in figs else []


def section_header(d: Mapping[str, Any]) -> list[str]:
    env = d.get("env", {})
    out = [f"# kvtax report: {d['run_id']}", ""]
    out.append(f"- model: {', '.join(d.get('models') or ['-'])}")
    out.append(f"- device: {env.get('device', '-')}; date: {env.get('timestamp', '-')}; "
               f"commit: {env.get('git_commit', '-')}")
    counts = d.get("counts", {})
    for kind, c in sorted(counts.items()):
        out.append(f"- {kind} rows: " + ", ".join(f"{v} {k}" for k, v in sorted(c.items())))
    if d.get("command"):
        out += ["", "Command:", "", "```", d["command"], "```"]
    return out + [""]


def section_engine_notes(a: Mapping[str, Any]) -> list[str]:
    """What the engines recorded about how their arms really ran (one line per note)."""
    notes = a.get("engine_notes") or []
    if not notes:
        return []
    out = ["## How the engines ran", ""]
    for n in notes:
        out.append(f"- {n['engine']} ({', '.join(n['arms'])}): {n['note']}")
    return out + [""]


def section_decode(a: Mapping[str, Any], figs: Mapping[str, str]) -> list[str]:
    pts = a.get("decode_points", {})
    if not pts:
        return []
    base = a.get("baseline")
    ctxs = _contexts(pts)
    modes = a.get("decode_mode") or {}
    out = ["## Decode: ms per generated token vs context", "",
           "Median over repetitions (robust CV in brackets); `*` marks a flagged cell, left "
           "out of the fit." + (" `decode ran`: captured = CUDA-graph replay, eager = one "
                                "launch per op." if modes else ""), ""]
    rows = []
    for arm, per in sorted(pts.items()):
        cells = []
        for c in ctxs:
            p = per.get(c)
            if p is None:
                cells.append("-")
                continue
            cv = "" if p["cv"] is None else f" ({p['cv']:.3f})"
            cells.append(f"{num(p['median'])}{cv}{' *' if p['flagged'] else ''}")
        rows.append([arm, *cells] + ([modes.get(arm, "-")] if modes else []))
    out += table(["arm", *[str(c) for c in ctxs]] + (["decode ran"] if modes else []), rows)
    fits, ratios = a.get("fits", {}), a.get("slope_ratios", {})
    if fits:
        out += [f"Fit `ms_per_token = t0 + m * context` per arm, unflagged cells only; slope "
                f"ratio = m({base}) / m(arm), predicted = bytes per token of {base} / arm's.", ""]
        with_flagged = a.get("slope_ratios_with_flagged")
        rows = []
        for arm, f in fits.items():
            r = ratios.get(arm, {})
            rows.append([
                arm, num(f["t0"]), num(f["m"] * 1000), num(f["r2"], 4), f["n"],
                ", ".join(str(c) for c in f["excluded"]) or "-",
                num(r.get("measured")), num(r.get("predicted")), num(r.get("vs_predicted")),
            ] + ([num(with_flagged.get(arm))] if with_flagged else []))
        out += table(["arm", "t0 (ms)", "m (ms per 1k ctx)", "R²", "points", "excluded",
                      "slope ratio", "predicted (bytes)", "measured / predicted"]
                     + (["slope ratio if flagged cells were kept"] if with_flagged else []), rows)
    unfit = sorted(set(pts) - set(fits))
    if unfit:
        out += [f"No fit for {', '.join(unfit)}: fewer than two unflagged contexts.", ""]
    return out + _fig(figs, "decode", "decode ms/token vs context")


def section_flagged(a: Mapping[str, Any]) -> list[str]:
    flagged = a.get("flagged", [])
    if not flagged:
        return []
    out = [f"## Flagged cells (noisy: robust CV above {a.get('cv_threshold')})", "",
           "These cells are excluded from every fit; a single noisy cell in an eight-point fit "
           "can produce a confident wrong slope (in a published sweep of Qwen3-8B-4bit on an M5 "
           "Pro with mlx-lm, one noisy cell turned a 4-bit slope ratio of 3.21 into 2.25).",
           ""]
    for f in flagged:
        out.append(f"- **{f['arm']} @ {f['context']}** ({f['metric']}): {f['reason']}; median "
                   f"{num(f['median'])} over {f['n']} reps")
    return out + [""]


def section_prefill(a: Mapping[str, Any], figs: Mapping[str, str]) -> list[str]:
    tt = a.get("ttft_points", {})
    if not tt:
        return []
    ctxs = _contexts(tt)
    tps = a.get("prefill_tok_s", {})
    out = ["## Prefill: time to first token", "", "TTFT in seconds (prefill tokens/s).", ""]
    rows = []
    for arm, per in sorted(tt.items()):
        cells = []
        for c in ctxs:
            p = per.get(c)
            rate = tps.get(arm, {}).get(c)
            cells.append("-" if p is None else
                         f"{num(p['median'])}{'' if rate is None else f' ({num(rate)})'}"
                         f"{' *' if p['flagged'] else ''}")
        rows.append([arm, *cells])
    out += table(["arm", *[str(c) for c in ctxs]], rows)
    pen, be = a.get("prefill_penalty", {}), a.get("break_even", {})
    base = a.get("baseline")
    if pen:
        out += [f"Prefill penalty: TTFT / TTFT({base}) (extra seconds).", ""]
        rows = [[arm, *[(f"{per[c]['ratio']:.2f}x ({num(per[c]['extra_s'])} s)"
                         f"{_noisy(a, arm, base, c, ('ttft_points',))}" if c in per else "-")
                        for c in ctxs]]
                for arm, per in sorted(pen.items()) if arm != base]
        out += table(["arm", *[str(c) for c in ctxs]], rows)
        if any("*" in str(x) for r in rows for x in r[1:]):
            out += ["`*`: rests on a flagged (noisy) TTFT cell.", ""]
    if be:
        out += [f"Break-even generated tokens against {base}: after this many tokens the arm's "
                "total time (TTFT + tokens x ms/token) is no longer worse; 0 = never slower, "
                "never = decode is not faster, so a slower prefill is never paid back.", ""]
        rows = [[arm, *[num(per.get(c)) + _noisy(a, arm, base, c) if c in per else "-"
                        for c in ctxs]]
                for arm, per in sorted(be.items())]
        out += table(["arm", *[str(c) for c in ctxs]], rows)
        if any("*" in str(x) for r in rows for x in r[1:]):
            out += ["`*`: rests on a flagged (noisy) TTFT or decode cell.", ""]
    return out + _fig(figs, "ttft", "time to first token vs context")


def _noisy(a: Mapping[str, Any], arm: str, base: str | None, ctx: int,
           metrics: Sequence[str] = ("ttft_points", "decode_points")) -> str:
    """' *' when a derived number uses a flagged (noisy) median of the arm or baseline."""
    for metric in metrics:
        for who in (arm, base):
            p = a.get(metric, {}).get(who or "", {}).get(ctx)
            if p and p["flagged"]:
                return " *"
    return ""


def section_memory(a: Mapping[str, Any], figs: Mapping[str, str]) -> list[str]:
    peaks = a.get("peaks", {})
    pre, dec, cache = peaks.get("prefill", {}), peaks.get("decode", {}), a.get("cache_bytes", {})
    if not (pre or dec or cache):
        return []
    grew = {(arm, int(c)) for arm, c in a.get("decode_growth", [])}
    used = a.get("cache_used_bytes", {})
    out = ["## Memory per phase", "", *_peak_meaning((a.get("meta") or {}).get("memory_kind")),
           "Peak counters are reset at each phase's start, so the prefill peak and the decode "
           "peak are separate numbers (a whole-run peak can hide that only prefill is "
           "inverted). The cache columns are exact: `allocated` is the cache's storage "
           "(preallocated capacity), `held` the bytes of the tokens in it. `grew` marks cells "
           "whose cache grew inside the decode window (the 256-boundary confound).", ""]
    arms = sorted(set(pre) | set(dec) | set(cache))
    rows = []
    for arm in arms:
        for c in sorted(set(pre.get(arm, {})) | set(dec.get(arm, {})) | set(cache.get(arm, {}))):
            rows.append([arm, c, size(pre.get(arm, {}).get(c)), size(dec.get(arm, {}).get(c)),
                         size(cache.get(arm, {}).get(c)), size(used.get(arm, {}).get(c)),
                         "grew" if (arm, c) in grew else ""])
    out += table(["arm", "context", "prefill peak", "decode peak", "cache allocated",
                  "cache held", "growth"], rows)
    return out + _fig(figs, "memory", "peak memory per phase vs context")


def _peak_meaning(kind: str | None) -> list[str]:
    """What the peak columns measure, from the rows' memory_kind."""
    if kind == "cpu_rss":
        return ["On CPU the peaks are the worker process's peak resident set size (VmHWM "
                "after /proc/self/clear_refs): it includes the Python interpreter, torch and "
                "the model's weights, and moves in whole pages and allocator arenas, so a cache "
                "difference of a few hundred KiB is within its noise. Read the cache columns "
                "for the cache itself.", ""]
    if kind == "cuda_allocated":
        return ["On CUDA the peaks are torch's peak allocated bytes in the phase (weights, "
                "cache and transients; reset at the phase's start).", ""]
    return []


def section_cost(a: Mapping[str, Any], price: float | None) -> list[str]:
    cost = a.get("cost_per_mtok")
    if price is None or not cost:
        return []
    ctxs = _contexts(cost)
    out = [f"## Cost per million generated tokens at ${price:g}/device-hour", "",
           "Decode time only, batch 1: price x (ms/token / 1000) x 10^6 / 3600. Prefill is "
           "paid once per prompt (see TTFT).", ""]
    rows = [[arm, *[f"${per[c]:,.2f}" if c in per else "-" for c in ctxs]]
            for arm, per in sorted(cost.items())]
    return out + table(["arm", *[str(c) for c in ctxs]], rows)


def section_recall(r: Mapping[str, Any], figs: Mapping[str, str],
                   config: Mapping[str, Any] | None = None) -> list[str]:
    grid = r.get("grid", {})
    if not grid:
        return []
    ctxs = _contexts(grid)
    out = ["## Recall: planted facts (correct / asked)", "",
           "Graded by the planted value (digit separators normalised, codes case-insensitive, "
           "a number inside a longer one is wrong), never by surrounding words.", ""]
    cfg = config or {}
    if cfg.get("kind") == "recall":
        out += [f"{cfg.get('facts')} facts per prompt (seed {cfg.get('seed')}), filler: "
                f"{cfg.get('filler') or 'pydoc_data/topics.py prose'}, engine: "
                f"{cfg.get('engine')}, chat template: {'on' if cfg.get('chat') else 'off'}, "
                f"answer budget: {cfg.get('max_new_tokens') or 'the fact sentence + 8'} tokens, "
                "greedy.", ""]
    rows = [[arm, *[f"{per[c][0]}/{per[c][1]}" if c in per else "-" for c in ctxs]]
            for arm, per in grid.items()]
    out += table(["arm", *[str(c) for c in ctxs]], rows)
    by_fact, fact_depths = r.get("by_fact", {}), r.get("fact_depths", {})
    facts = sorted({int(f) for per in by_fact.values() for f in per})
    if facts:
        out += ["By fact, all contexts; the header is the fact's depth in the document "
                "(0 = first, 1 = last; mean over contexts):", ""]
        rows = [[arm, *[f"{per[f][0]}/{per[f][1]}" if f in per else "-" for f in facts]]
                for arm, per in by_fact.items()]
        out += table(["arm", *[f"{float(fact_depths.get(f, 0.0)):.2f}" for f in facts]], rows)
    wrong = r.get("wrong", [])
    if wrong:
        out += ["Wrong answers (first 20; spot-check failures, not passes):", ""]
        out += table(["arm", "context", "fact", "depth", "expected", "answer"],
                     [[w["arm"], w["context"], w["fact_index"], f"{float(w['depth'] or 0):.2f}",
                       w["expected"], repr(w["answer"])[:80]] for w in wrong[:20]])
    return out + _fig(figs, "recall", "recall grid")


def section_roofline(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    if not rows:
        return []
    out = ["## Roofline", ""]
    out += table(["op", "arm", "context", "time (ms)", "GB/s", "of peak GB/s", "TFLOP/s",
                  "compute headroom"],
                 [[r["op"], r["arm"], r["context"], num((r["time_s"] or 0) * 1e3),
                   num(r["achieved_gbs"]), num(r["bandwidth_fraction"]),
                   num(r["achieved_tflops"]), num(r["compute_headroom"])] for r in rows])
    return out


def section_arms(arms: Sequence[str]) -> list[str]:
    """One line per attention path among `arms` ("kv/path"): what that path stands for."""
    paths = [p for p in PATH_MEANING if any(a.rsplit("/", 1)[-1] == p for a in arms)]
    if not paths:
        return []
    out = ["## What the arms are", "",
           "An arm is a KV format / an attention path; the paths in this run:", ""]
    return out + [f"- `{p}`: {PATH_MEANING[p]}." for p in paths] + [""]


def section_failures(fails: Sequence[Mapping[str, Any]]) -> list[str]:
    """Cells without a measurement, one table row per arm, status, phase and reason (the
    reason's context number stands as <ctx>, so an arm capped at every context is one row)."""
    if not fails:
        return []
    out = ["## Cells that did not complete (OOM, error, timeout, unavailable, skipped)", ""]
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for f in fails:
        err = (f.get("error") or "").strip().splitlines()
        why = (err[-1] if err else "")[:160].replace(f"context {f['context']} ", "context <ctx> ")
        key = (f["kind"], f["arm"], f["status"], f.get("phase") or "-", why)
        groups.setdefault(key, []).append(f)
    rows = []
    for (kind, arm, status, phase, why), fs in groups.items():
        ctxs = sorted({int(f["context"]) for f in fs})
        rows.append([kind, arm, ", ".join(str(c) for c in ctxs), len(fs), status, phase, why])
    return out + table(["kind", "arm", "contexts", "cells", "status", "phase", "error"], rows)


def section_claims(a: Mapping[str, Any]) -> list[str]:
    claims = a.get("claims", [])
    if not claims:
        return []
    out = ["## Claims stated before the run", ""]
    rows = [[c["claim"], c["verdict"].upper(), c["why"]] for c in claims]
    return out + table(["claim", "verdict", "numbers"], rows)


_ENV_KEYS = ("device", "device_type", "driver", "cuda", "torch", "triton", "transformers",
             "kvtax", "numpy", "git_commit", "timestamp", "hostname", "cpu", "torch_threads")


def section_environment(d: Mapping[str, Any]) -> list[str]:
    env = d.get("env", {})
    if not env:
        return ["## Environment", "", "env.json is missing from the run folder.", ""]
    keys = [k for k in _ENV_KEYS if k in env]
    keys += sorted(k for k, v in env.items()
                   if k not in keys and k not in ("argv", "previous")
                   and isinstance(v, (str, int, float, bool)))
    out = ["## Environment", ""]
    out += table(["key", "value"], [[k, env[k]] for k in keys])
    if env.get("previous"):
        out += [f"The run was resumed {len(env['previous'])} time(s); earlier environments "
                "are in env.json under `previous`.", ""]
    return out
