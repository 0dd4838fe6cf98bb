"""Planted-fact recall of each KV format against a baseline's, fact by fact, over runs.

`kvtax recall` writes one row per question; a seed's questions are the same in every run
(same model, contexts, facts and seed), so several run folders (seeds, or arms run apart)
pool into one table. Per format and context it counts what the baseline recalled, how many
of those the format kept, and how many the format recalled that the baseline missed. Two
formats with the same total can differ fact by fact; "kept" is what the docs' tables quote.

A format's lost and gained facts are the discordant pairs of a paired comparison, so the
table gives McNemar's exact two-sided p: how likely a split at least this uneven is if the
format recalled as well as the baseline and only which facts flip were chance. Why it
matters: a 4-bit cache's lost facts move with the kernels' rounding (a key at a code
boundary takes the other code; docs/QUALITY.md), so "kept" alone is one draw. With more
than one context, an `all` row pools them.

    python benchmarks/recall_tally.py docs/results/2026-12-03-h200-recall-qwen-8seeds/*-s*
    python benchmarks/recall_tally.py RUN [RUN ...] --baseline fp16 --swaps
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

Key = tuple[int, int, int]  # (seed, context, fact index)


def load_answers(run_dirs: list[str]) -> dict[str, dict[Key, dict]]:
    """kv → (seed, context, fact) → row, over every rows.jsonl under `run_dirs`; rows that
    did not produce an answer (status other than ok) are left out. A question answered
    twice for one kv must agree (the runs are deterministic), else ValueError."""
    out: dict[str, dict[Key, dict]] = defaultdict(dict)
    files = [p for d in run_dirs for p in sorted(Path(d).rglob("rows.jsonl"))]
    if not files:
        raise ValueError(f"no rows.jsonl under {', '.join(run_dirs)}")
    for path in files:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") != "recall" or row.get("status") != "ok":
                continue
            key = (int(row["order_seed"]), int(row["context"]), int(row["fact_index"]))
            seen = out[row["kv"]].get(key)
            if seen is not None and bool(seen["correct"]) != bool(row["correct"]):
                raise ValueError(f"{row['kv']} seed {key[0]} context {key[1]} fact {key[2]}: "
                                 f"two runs disagree ({path})")
            out[row["kv"]][key] = row
    return out


def tally(answers: dict[str, dict[Key, dict]], baseline: str) -> list[dict]:
    """One dict per (kv, context): asked (questions both the format and the baseline
    answered), seeds, base (baseline right), right, kept (both right), gained (format right,
    baseline wrong), lost (the baseline's right answers the format missed, as keys)."""
    if baseline not in answers:
        raise ValueError(f"baseline {baseline!r} has no rows; kvs: {', '.join(sorted(answers))}")
    base = answers[baseline]
    rows = []
    for kv, got in answers.items():
        for ctx in sorted({k[1] for k in got}):
            keys = sorted(k for k in got if k[1] == ctx and k in base)
            if not keys:
                continue
            b = [bool(base[k]["correct"]) for k in keys]
            f = [bool(got[k]["correct"]) for k in keys]
            rows.append({
                "kv": kv, "context": ctx, "asked": len(keys),
                "seeds": len({k[0] for k in keys}), "base": sum(b), "right": sum(f),
                "kept": sum(x and y for x, y in zip(b, f)),
                "gained": sum(y and not x for x, y in zip(b, f)),
                "lost": [k for k, x, y in zip(keys, b, f) if x and not y],
            })
    return with_pooled(rows)


def with_pooled(rows: list[dict]) -> list[dict]:
    """`rows` with, after each kv's contexts (more than one), an `all` row summing them."""
    out: list[dict] = []
    for kv in dict.fromkeys(r["kv"] for r in rows):
        mine = [r for r in rows if r["kv"] == kv]
        out += mine
        if len(mine) > 1:
            out.append({"kv": kv, "context": "all", "seeds": max(r["seeds"] for r in mine),
                        **{f: sum(r[f] for r in mine)
                           for f in ("asked", "base", "right", "kept", "gained")},
                        "lost": [k for r in mine for k in r["lost"]]})
    return out


def mcnemar_p(lost: int, gained: int) -> float:
    """Exact two-sided McNemar p for `lost` vs `gained` discordant pairs: twice the
    binomial(lost + gained, 1/2) tail at the smaller count, at most 1."""
    n = lost + gained
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1))
    return min(1.0, 2 * tail / 2 ** n) if n else 1.0


def render(rows: list[dict], baseline: str) -> str:
    lines = [f"| kv | context | seeds | asked | {baseline} right | right | kept of {baseline}'s "
             f"| gained | p (McNemar) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = mcnemar_p(len(r["lost"]), r["gained"])
        lines.append(f"| {r['kv']} | {r['context']} | {r['seeds']} | {r['asked']} | "
                     f"{r['base']} | {r['right']} | {r['kept']} / {r['base']} | {r['gained']} "
                     f"| {p:.2g} |")
    return "\n".join(lines)


def swaps(answers: dict[str, dict[Key, dict]], baseline: str, kv: str) -> list[str]:
    """Each question where `kv` and the baseline differ: what each answered, and whether the
    baseline gets that fact right at the seed's other contexts (a fact it also misses
    elsewhere sits near the model's limit)."""
    base, got = answers[baseline], answers[kv]
    out = []
    for k in sorted(k for k in got if k in base):
        if bool(got[k]["correct"]) == bool(base[k]["correct"]):
            continue
        seed, ctx, fact = k
        elsewhere = [bool(base[o]["correct"]) for o in sorted(base)
                     if o[0] == seed and o[2] == fact and o[1] != ctx]
        verdict = "lost" if base[k]["correct"] else "gained"
        out.append(f"{verdict}: seed {seed} context {ctx} fact {fact}: expected "
                   f"{got[k]['expected']!r}, {kv} {got[k]['answer']!r}, {baseline} "
                   f"{base[k]['answer']!r}; {baseline} right at its other contexts: "
                   f"{sum(elsewhere)} of {len(elsewhere)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="kvtax recall run folders (searched for rows.jsonl)")
    ap.add_argument("--baseline", default="fp16", help="the kv the others are held to")
    ap.add_argument("--swaps", action="store_true", help="list every question a format "
                    "answers differently from the baseline")
    args = ap.parse_args(argv)
    try:
        answers = load_answers(args.runs)
        rows = tally(answers, args.baseline)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        print(f"recall_tally: {e}", file=sys.stderr)
        return 2
    print(render(rows, args.baseline))
    if args.swaps:
        for kv in answers:
            if kv != args.baseline:
                for line in swaps(answers, args.baseline, kv):
                    print(f"{kv} {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
