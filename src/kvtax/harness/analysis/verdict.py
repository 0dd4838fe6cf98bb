"""Does a quantized KV cache pay off here? The answer, computed from a run's statistics.

Every number is against the run's best fp16 arm (`analysis.summarize`'s `baseline`):

- per quantized arm: the context from which its decode is faster (at that and every larger
  measured context), by how much at the largest shared context, the prefill penalty and the
  break-even generated tokens there, how many more tokens fit the device's memory, and its
  quality (KL, recall) when quality or recall rows were given;
- the practical advice grid: for each context x generated tokens (64, 512, 4096), which arm
  finishes first (TTFT + n x decode ms) among those that fit in memory.

    >>> v = verdict(analysis, env, weight_bytes=16e9, quality_rows=[], recall_grid={})
    >>> v["pays_off"], v["formats"][0]["faster_from"], v["advice"][65536][4096]["winner"]
    (True, 16384, 'int8/fused')
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any

from kvtax.harness.analysis import stats

GENERATED = (64, 512, 4096)


def device_memory(env: Mapping[str, Any]) -> tuple[int | None, str]:
    """Bytes of the run's device memory and what they are: CUDA total memory from env.json,
    else the CPU's MemTotal (env.json's, or /proc/meminfo when the report runs on the same
    host as the sweep); (None, why) when unknown."""
    if env.get("gpu_memory_bytes"):
        return int(env["gpu_memory_bytes"]), "CUDA total memory (env.json)"
    if env.get("mem_total_bytes"):
        return int(env["mem_total_bytes"]), "CPU MemTotal (env.json)"
    if env.get("device_type", "cpu").startswith("cpu") and env.get("hostname") == \
            socket.gethostname():
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        return (int(line.split()[1]) * 1024,
                                "CPU MemTotal, /proc/meminfo of the host that ran the sweep")
        except OSError:
            pass
    return None, "device memory unknown (env.json has no total memory)"


def _median(a: Mapping[str, Any], key: str, arm: str, ctx: int) -> float | None:
    p = a.get(key, {}).get(arm, {}).get(ctx)
    return None if p is None else float(p["median"])


def faster_from(a: Mapping[str, Any], arm: str, base: str) -> int | None:
    """Smallest measured context from which `arm` decodes faster than `base` at it and at
    every larger context both measured (None: not at the largest one)."""
    dec = a.get("decode_points", {})
    common = sorted(set(dec.get(arm, {})) & set(dec.get(base, {})))
    start = None
    for ctx in reversed(common):
        if dec[arm][ctx]["median"] < dec[base][ctx]["median"]:
            start = ctx
        else:
            break
    return start


def capacity(free: int | None, bpt: float | None) -> int | None:
    """Tokens of KV that fit `free` bytes at `bpt` bytes per token (None when unknown)."""
    return None if free is None or not bpt else int(free // bpt)


def quality_of(kv: str, arm: str, quality_rows: Sequence[Mapping[str, Any]],
               recall_grid: Mapping[str, Mapping[int, Sequence[int]]]) -> dict[str, Any]:
    """KL (nats, at the largest context with a quality row for `kv`) and recall (correct /
    asked over every context, by arm name, else by format on any path)."""
    out: dict[str, Any] = {}
    mine = [r for r in quality_rows if str(r.get("kv")) == kv and r.get("kl") is not None]
    if mine:
        top = max(mine, key=lambda r: int(r["context"]))
        out.update(kl=float(top["kl"]), kl_context=int(top["context"]))
    grid = recall_grid.get(arm) or next(
        (per for name, per in recall_grid.items() if name.split("/")[0] == kv), None)
    if grid:
        out["recall"] = [sum(int(v[0]) for v in grid.values()),
                         sum(int(v[1]) for v in grid.values())]
    return out


def format_rows(a: Mapping[str, Any], free: int | None,
                quality_rows: Sequence[Mapping[str, Any]],
                recall_grid: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One dict per quantized arm with decode points: the verdict table's row."""
    base = a["baseline"]
    bpt = a.get("bytes_per_token", {})
    dec = a.get("decode_points", {})
    base_tokens = capacity(free, bpt.get(base))
    out = []
    for arm in sorted(dec):
        if stats.is_unquantized(arm):
            continue
        common = sorted(set(dec[arm]) & set(dec.get(base, {})))
        top = common[-1] if common else None
        speedup = None if top is None else \
            _median(a, "decode_points", base, top) / _median(a, "decode_points", arm, top)
        tokens = capacity(free, bpt.get(arm))
        out.append({
            "arm": arm, "at": top, "faster_from": faster_from(a, arm, base),
            "decode_speedup": speedup,
            "prefill_penalty": a.get("prefill_penalty", {}).get(arm, {}).get(top, {})
            .get("ratio"),
            "break_even": a.get("break_even", {}).get(arm, {}).get(top),
            "slope_ratio": a.get("slope_ratios", {}).get(arm, {}).get("measured"),
            "predicted": a.get("slope_ratios", {}).get(arm, {}).get("predicted"),
            "tokens_fit": tokens,
            "tokens_fit_ratio": None if not (tokens and base_tokens) else tokens / base_tokens,
            **quality_of(arm.split("/")[0], arm, quality_rows, recall_grid),
        })
    return out


def finish_s(a: Mapping[str, Any], arm: str, ctx: int, n: int) -> float | None:
    """Seconds to answer a `ctx`-token prompt with `n` tokens: measured TTFT + n x decode
    ms/token, decode from the arm's fit at the mean context of the answer (ctx + n/2)
    where it has one with a positive slope (a noisy fit must not extrapolate to a negative
    time), else its median at ctx. None when TTFT was not measured at ctx."""
    ttft = _median(a, "ttft_points", arm, ctx)
    fit = a.get("fits", {}).get(arm)
    ms = (fit["t0"] + fit["m"] * (ctx + n / 2) if fit and fit["m"] > 0
          else _median(a, "decode_points", arm, ctx))
    if ttft is None or ms is None:
        return None
    return ttft + n * ms / 1000.0


def fits_memory(a: Mapping[str, Any], arm: str, ctx: int, n: int, memory: int | None,
                weights: int | None) -> bool | None:
    """Whether prompt + answer fit: the arm's measured peak at ctx (largest phase) plus n
    tokens of KV, else weights + (ctx + n) tokens of KV; None when memory is unknown."""
    if memory is None:
        return None
    bpt = float(a.get("bytes_per_token", {}).get(arm) or 0)
    peaks = [a.get("peaks", {}).get(ph, {}).get(arm, {}).get(ctx) for ph in ("prefill",
                                                                           "decode")]
    peaks = [p for p in peaks if p]
    need = max(peaks) + n * bpt if peaks else (weights or 0) + (ctx + n) * bpt
    return need <= memory


def advice_grid(a: Mapping[str, Any], memory: int | None, weights: int | None,
                generated: Sequence[int] = GENERATED) -> dict[int, dict[int, dict[str, Any]]]:
    """context -> generated tokens -> {winner, seconds: {arm: s}, misfit: [arms], noisy};
    the winner finishes first among the arms that fit in memory; `noisy`: its points at
    that context are flagged."""
    arms = sorted(a.get("ttft_points", {}))
    ctxs = sorted({int(c) for per in a.get("ttft_points", {}).values() for c in per})
    out: dict[int, dict[int, dict[str, Any]]] = {}
    for ctx in ctxs:
        for n in generated:
            secs = {arm: s for arm in arms if (s := finish_s(a, arm, ctx, n)) is not None}
            misfit = [arm for arm in secs if fits_memory(a, arm, ctx, n, memory, weights)
                      is False]
            ok = {arm: s for arm, s in secs.items() if arm not in misfit}
            winner = min(sorted(ok), key=lambda x: ok[x]) if ok else None
            out.setdefault(ctx, {})[n] = {"winner": winner, "seconds": secs, "misfit": misfit,
                                          "noisy": bool(winner) and noisy(a, winner, ctx)}
    return out


def noisy(a: Mapping[str, Any], arm: str, ctx: int) -> bool:
    """Whether the arm's decode or TTFT point at ctx is flagged (robust CV or clocks)."""
    return any((a.get(k, {}).get(arm, {}).get(ctx) or {}).get("flagged")
               for k in ("decode_points", "ttft_points"))


def _kv_win(a: Mapping[str, Any], arm: str | None, ctx: int) -> bool:
    """A quantized arm finishing first because of its cache: it also decodes faster than
    every unquantized arm there (a win on prefill alone is not the cache paying off), and
    neither of its points there is flagged noisy."""
    if not arm or stats.is_unquantized(arm) or noisy(a, arm, ctx):
        return False  # a noisy point is left out here as it is from every fit
    mine = _median(a, "decode_points", arm, ctx)
    refs = [m for x in a.get("decode_points", {}) if stats.is_unquantized(x)
            and (m := _median(a, "decode_points", x, ctx)) is not None]
    return mine is not None and bool(refs) and mine < min(refs)


def verdict(a: Mapping[str, Any], env: Mapping[str, Any], *, weight_bytes: int | None,
            model: str = "the model", quality_rows: Sequence[Mapping[str, Any]] = (),
            recall_grid: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The verdict of one run: baseline, memory, per-format rows, advice grid; `pays_off`
    is whether a quantized arm finishes first anywhere in the grid while decoding faster
    than the best fp16 arm there."""
    memory, source = device_memory(env)
    free = None if memory is None else memory - int(weight_bytes or 0)
    rows = format_rows(a, free, quality_rows, recall_grid or {})
    grid = advice_grid(a, memory, weight_bytes)
    wins = [(ctx, n, cell["winner"]) for ctx, per in grid.items() for n, cell in per.items()
            if _kv_win(a, cell["winner"], ctx)]
    noisy = [f for f in a.get("flagged", []) if not f["arm"].endswith("hf-quantized")]
    total = sum(len(per) for key in ("decode_points", "ttft_points")
                for per in a.get(key, {}).values())
    out: dict[str, Any] = {
        "baseline": a["baseline"], "baseline_rule": a.get("baseline_rule"),
        "device": env.get("device", "this device"), "model": model,
        "memory_bytes": memory, "memory_source": source, "weight_bytes": weight_bytes,
        "formats": rows, "advice": grid, "quantized_wins": wins,
        "pays_off": bool(wins), "noisy_points": len(noisy), "points": total,
        "cv_threshold": a.get("cv_threshold"),
    }
    return out
