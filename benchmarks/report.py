"""Markdown summary of benchmarks/attention.py rows: tables per phase and the targets."""

from __future__ import annotations


def _ctx_label(c: int) -> str:
    return f"{c // 1024}k" if c % 1024 == 0 else str(c)


def _cell(r: dict | None, phase: str) -> str:
    if r is None:
        return "–"
    if r["status"] != "ok":
        return r["status"]
    if phase == "decode":
        frac = f" ({100 * r['frac_ceiling']:.0f}%)" if r.get("frac_ceiling") else ""
        return f"{r['median_ms']:.3f} ms · {r['tbps']:.2f} TB/s{frac}"
    return f"{r['median_ms']:.2f} ms · {r['tflops']:.0f} TFLOP/s"


def markdown_summary(rows: list[dict], config: dict) -> str:
    main = [r for r in rows if "@" not in r["arm"]]
    sweep = [r for r in rows if "@" in r["arm"]]
    ctxs = sorted({r["ctx"] for r in main})
    arms = list(dict.fromkeys(r["arm"] for r in main))
    idx = {(r["arm"], r["phase"], r["ctx"]): r for r in rows}
    out = [
        f"Device: {config['device']}; torch {config['torch']}; triton {config['triton']}; "
        f"{config['date']}; git {config['git']}",
        f"Command: `{config['command']}`",
        f"Streaming-read ceiling (best of {len(config.get('read_ceiling_kernels', []))} "
        f"read kernels): {config.get('read_ceiling_tbps', float('nan')):.2f} TB/s",
        "",
    ]
    for phase in ("decode", "prefill"):
        if not any(r["phase"] == phase for r in main):
            continue
        n_q = next(r["rows"] for r in main if r["phase"] == phase)
        unit = "ms · TB/s of cache bytes (% of read ceiling)" if phase == "decode" else "ms · TFLOP/s"
        out += [f"### {phase} ({n_q} query rows; {unit})", "",
                "| arm | " + " | ".join(_ctx_label(c) for c in ctxs) + " |",
                "|---|" + "---|" * len(ctxs)]
        for a in arms:
            out.append(f"| {a} | " + " | ".join(_cell(idx.get((a, phase, c)), phase) for c in ctxs) + " |")
        out.append("")
    out += in_layer_table(main, ctxs, arms, idx)
    out += ["### transient memory (MiB, peak above baseline during one call, output included)", "",
            "| arm | " + " | ".join(f"{p} {_ctx_label(c)}" for p in ("decode", "prefill") for c in ctxs) + " |",
            "|---|" + "---|" * (2 * len(ctxs))]
    for a in arms:
        cells = []
        for p in ("decode", "prefill"):
            for c in ctxs:
                r = idx.get((a, p, c))
                cells.append("–" if r is None or r["status"] != "ok" else f"{r['transient_mib']:.0f}")
        out.append(f"| {a} | " + " | ".join(cells) + " |")
    out += ["", *targets(idx, ctxs, arms)]
    if sweep:
        out += ["", "### launch-config sweep (kvtax)", "", "| arm@config | phase | ctx | ms | TB/s | TFLOP/s |",
                "|---|---|---|---|---|---|"]
        for r in sweep:
            if r["status"] == "ok":
                out.append(f"| {r['arm']} | {r['phase']} | {_ctx_label(r['ctx'])} | {r['median_ms']:.3f} | "
                           f"{r['tbps']:.2f} | {r['tflops']:.0f} |")
            else:
                out.append(f"| {r['arm']} | {r['phase']} | {_ctx_label(r['ctx'])} | {r['status']} | | |")
    return "\n".join(out) + "\n"


def in_layer_table(main: list[dict], ctxs: list[int], arms: list[str], idx: dict) -> list[str]:
    """kvtax decode timed between its neighbours in a decode step (attention.py's
    in_layer): µs on the critical path beside the graph-first time, and the fraction of
    the read ceiling at that time."""
    have = [a for a in arms if any(r.get("in_layer_ms") for r in main if r["arm"] == a)]
    if not have:
        return []
    mode = next(r["in_layer"] for r in main if r.get("in_layer_ms"))
    out = [f"### decode in a layer ({mode}: µs on the critical path, split + reduce, as "
           "`decode.py --profile` charges a model layer; first-in-graph µs; % of read ceiling)", "",
           "| arm | " + " | ".join(_ctx_label(c) for c in ctxs) + " |", "|---|" + "---|" * len(ctxs)]
    for a in have:
        cells = []
        for c in ctxs:
            r = idx.get((a, "decode", c))
            if r is None or not r.get("in_layer_ms"):
                cells.append("–")
                continue
            ms = r["in_layer_ms"]
            frac = (r["frac_ceiling"] * r["median_ms"] / ms) if r.get("frac_ceiling") else None
            cells.append(f"{1e3 * ms:.1f} (first {1e3 * r['median_ms']:.1f})"
                         + (f" · {100 * frac:.0f}%" if frac else ""))
        out.append(f"| {a} | " + " | ".join(cells) + " |")
    return out + [""]


def targets(idx: dict, ctxs: list[int], arms: list[str]) -> list[str]:
    """The issue's targets, checked at the largest context."""
    c = max(ctxs)
    ok = lambda a, p, cc=c: (r := idx.get((a, p, cc))) is not None and r["status"] == "ok"  # noqa: E731
    lines = [f"### targets at {_ctx_label(c)}", ""]
    sdpa = [idx[(a, "decode", c)] for a in ("sdpa-flash", "sdpa-cudnn") if ok(a, "decode")]
    if sdpa:
        best = min(sdpa, key=lambda r: r["median_ms"])
        base = best["median_ms"]
        for arm, bound in (("kvtax-int8", 0.60), ("kvtax-int4", 0.40), ("kvtax-fp16", 1.15)):
            if ok(arm, "decode"):
                ratio = idx[(arm, "decode", c)]["median_ms"] / base
                lines.append(f"- {arm} decode / {best['arm']} decode = {ratio:.2f} (target <= {bound:.2f}): "
                             f"{'held' if ratio <= bound else 'MISSED'}")
    flash = [idx[(a, "prefill", c)] for a in ("sdpa-flash", "sdpa-cudnn") if ok(a, "prefill")]
    if flash:
        best = max(flash, key=lambda r: r["tflops"])
        for arm in ("kvtax-int8", "kvtax-int4"):
            if ok(arm, "prefill"):
                ratio = idx[(arm, "prefill", c)]["tflops"] / best["tflops"]
                lines.append(f"- {arm} prefill TFLOP/s / {best['arm']} = {ratio:.2f} (target >= 0.70): "
                             f"{'held' if ratio >= 0.7 else 'MISSED'}")
        for arm in ("kvtax-int8", "kvtax-int4"):
            worse = [cc for cc in ctxs if ok(arm, "prefill", cc) and ok("sdpa-flash", "prefill", cc)
                     and idx[(arm, "prefill", cc)]["transient_mib"]
                     > idx[("sdpa-flash", "prefill", cc)]["transient_mib"] + 1e-6]
            lines.append(f"- {arm} prefill transient memory <= sdpa-flash's at every context: "
                         f"{'held' if not worse else 'MISSED at ' + ', '.join(map(_ctx_label, worse))}")
    lines += q4_targets(idx, c, ok, flash)
    lines += ceiling_targets(idx, ctxs, ok)
    return lines


def ceiling_targets(idx: dict, ctxs: list[int], ok) -> list[str]:  # noqa: ANN001
    """Issue 28's aims from 64k on: int8 >= 85% and int4 >= 75% of the read ceiling
    (first-in-graph time), kvtax fp16 at least cuDNN's speed; fp8 for the record."""
    lines = []
    for arm, aim in (("kvtax-int8", 0.85), ("kvtax-int4", 0.75), ("kvtax-fp8", None)):
        cc = [c for c in ctxs if c >= 65536 and ok(arm, "decode", c)]
        fr = [idx[(arm, "decode", c)].get("frac_ceiling") for c in cc]
        if not fr or any(f is None for f in fr):
            continue
        got = ", ".join(f"{_ctx_label(c)} {100 * f:.0f}%" for c, f in zip(cc, fr))
        verdict = "" if aim is None else (": held" if min(fr) >= aim else ": MISSED")
        aim_s = "" if aim is None else f" (target >= {100 * aim:.0f}%)"
        lines.append(f"- {arm} decode, fraction of the read ceiling{aim_s}: {got}{verdict}")
    cc = [c for c in ctxs if c >= 65536 and ok("kvtax-fp16", "decode", c) and ok("sdpa-cudnn", "decode", c)]
    if cc:
        r = [idx[("kvtax-fp16", "decode", c)]["median_ms"] / idx[("sdpa-cudnn", "decode", c)]["median_ms"]
             for c in cc]
        lines.append("- kvtax-fp16 at least sdpa-cudnn's decode speed from 64k (ms ratio <= 1.00 "
                     "within the cells' spread): "
                     + ", ".join(f"{_ctx_label(c)} {x:.3f}" for c, x in zip(cc, r)))
    return lines


def q4_targets(idx: dict, c: int, ok, flash: list[dict]) -> list[str]:  # noqa: ANN001
    """Issue 26's kernel targets for q4 (`kvtax-q4`, the whole spec) and its body
    (`kvtax-k4wc64v4`; `kvtax-k4c64v4` without the fifth key bit, `kvtax-int4c64` those
    keys beside int4-g32 values; `kvtax-q4k` the spec without it): decode no
    slower than plain int4 by more than 10%, prefill at >= 0.8 of the best SDPA's TFLOP/s
    (ratios to 3 digits: a target is held or missed on the printed value's side)."""
    lines = []
    for arm in ("kvtax-q4", "kvtax-k4wc64v4", "kvtax-q4k", "kvtax-k4c64v4", "kvtax-int4c64"):
        if ok(arm, "decode") and ok("kvtax-int4", "decode"):
            ratio = (idx[(arm, "decode", c)]["median_ms"]
                     / idx[("kvtax-int4", "decode", c)]["median_ms"])
            lines.append(f"- {arm} decode / kvtax-int4 decode = {ratio:.3f} (target <= 1.10): "
                         f"{'held' if ratio <= 1.10 else 'MISSED'}")
        if flash and ok(arm, "prefill"):
            best = max(flash, key=lambda r: r["tflops"])
            ratio = idx[(arm, "prefill", c)]["tflops"] / best["tflops"]
            lines.append(f"- {arm} prefill TFLOP/s / {best['arm']} = {ratio:.3f} "
                         f"(target >= 0.80): {'held' if ratio >= 0.8 else 'MISSED'}")
    return lines
