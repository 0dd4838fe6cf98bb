"""The row format every harness measurement is written in (one flat JSON object per line).

Statistics, reports and resumption read only `rows.jsonl`, so this module is the contract
between the measuring side (bench, roofline) and the reading side (report, recall).

    >>> row = base_row(cell, run_id="20260101T000000-x", device="cpu", git_commit="abc")
    >>> row.update(status="ok", ttft_s=0.12, ...)
    >>> validate_row(row)          # raises SchemaError naming every missing/ill-typed key
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

SCHEMA_VERSION = 1

KINDS = ("bench", "recall", "quality", "roofline")
# skipped: not run on purpose (a max_context budget, or skip_after_failure); error says why.
STATUSES = ("ok", "oom", "error", "timeout", "unavailable", "skipped")
PATHS = ("fused", "fp16", "unfused", "dequant", "hf-quantized")
# What each path of kvtax's engine stands for, as a report's reader needs it.
PATH_MEANING = {
    "fused": "kvtax's attention() reading the cache in its own format (Triton on CUDA)",
    "fp16": "the stock baseline: an unquantized fp16 cache read by torch SDPA (its fastest "
            "backend here) in the same runner",
    "unfused": "mlx-lm's composition: scores = q·Kᵀ materialized as [heads, chunk, context] "
               "in the model dtype, softmax, scores·V. It stands for mlx-lm's prefill "
               "(the score transient and its cost); in decode it decodes the whole K and V "
               "with torch ops every step, which mlx-lm's quantized_matmul does not (it reads "
               "the packed cache), so mlx-lm's own decode is faster than this row",
    "dequant": "transformers QuantizedCache's way: a dequantized copy of the whole cache, "
               "per layer, every step, then SDPA",
    "hf-quantized": "transformers' own QuantizedCache (its quanto / HQQ backend)",
}
# Rows of another engine (`engine` key, absent = "kvtax") carry that engine's own paths.
PHASES = ("setup", "prefill", "decode")

# Keys on every row, with the JSON types they may take (None: may be null).
COMMON_KEYS: dict[str, tuple[type | None, ...]] = {
    "schema": (int,),
    "run_id": (str,),
    "cell_id": (str,),
    "kind": (str,),
    "seq": (int,),
    "order_seed": (int,),
    "rep": (int,),
    "warmup": (bool,),
    "model": (str,),
    "arm": (str,),
    "kv": (str,),
    "path": (str,),
    "context": (int,),
    "chunk_size": (int, None),
    "decode_tokens": (int, None),
    "status": (str,),
    "phase": (str, None),
    "error": (str, None),
    "timestamp": (str,),
    "device": (str,),
    "git_commit": (str, None),
}

_NUM = (int, float, None)
BENCH_KEYS: dict[str, tuple[type | None, ...]] = {
    "ttft_s": _NUM,
    "prefill_tok_s": _NUM,
    "prefill_peak_bytes": (int, None),
    "decode_ms_per_token": _NUM,
    "decode_ms_samples": (list, None),
    "decode_peak_bytes": (int, None),
    "decode_growth": (bool, None),
    "cache_bytes": (int, None),
    "bytes_per_token": (int, None),
    "clocks_start": (dict, None),
    "clocks_end": (dict, None),
    "presized": (bool,),
    "quantized_kv_start": (int,),
}

# Extra keys bench rows carry (not required; readers must tolerate their absence).
BENCH_EXTRA_KEYS = {
    "level": '"model" (whole decoder) or "attention" (one layer\'s attention op)',
    "memory_kind": '"cuda_allocated", "cpu_rss", or null when peaks cannot be measured',
    "prefill_base_bytes": "memory level at prefill start (peak - base = what prefill added)",
    "decode_base_bytes": "memory level at decode start",
    "cache_used_bytes": "bytes of the tokens held (cache_bytes is what is allocated)",
    "prefill_growth_events": "cache reallocations during the prompt",
    "decode_growth_events": "cache reallocations inside the timed decode window",
    "decode_ms_median": "median of decode_ms_samples (decode_ms_per_token is their mean)",
    "cuda_graph": "whether decode replayed a CUDA graph (model level; attention level is "
                  "always false)",
    "graph_off_reason": "why decode ran eagerly (null when captured or not attempted)",
    "sdpa_backend": "torch SDPA backend the fp16 / dequant path's decode dispatched to "
                    "(null: no SDPA)",
    "weight_bytes": "model parameter bytes (model level)",
    "layer_shape": "[query heads, KV heads, head_dim] (attention level)",
    "traceback": "the worker's traceback on status error",
    "engine_version": 'the measured stack\'s version, e.g. "llama-cpp-python 0.3.36"',
    "engine_spec": "the arm's settings the engine ran with (kv, path, threads, options...)",
    "engine_info": "what the engine reports it really ran (attention path, backend...)",
    "baseline_arm": "the arm this engine's others are compared with (its unquantized one)",
}

RECALL_KEYS: dict[str, tuple[type | None, ...]] = {
    "fact_index": (int,),
    "depth": (int, float),
    "expected": (str,),
    "answer": (str, None),
    "correct": (bool, None),
}

ROOFLINE_KEYS: dict[str, tuple[type | None, ...]] = {
    "op": (str,),                   # "stream" | "matmul" | "attention"
    "time_s": _NUM,                 # median seconds per call
    "bytes_moved": (int, None),     # bytes the op must read + write
    "flops": (int, float, None),
    "achieved_gbs": _NUM,
    "achieved_tflops": _NUM,
    "peak_gbs": _NUM,               # the device's measured streaming bandwidth
    "peak_tflops": _NUM,            # the device's measured matmul rate
    "bandwidth_fraction": _NUM,     # achieved_gbs / peak_gbs
    "compute_headroom": _NUM,       # peak_tflops / achieved_tflops
}

KIND_KEYS = {"bench": BENCH_KEYS, "recall": RECALL_KEYS, "roofline": ROOFLINE_KEYS}


class SchemaError(ValueError):
    """A row that does not follow the schema."""


def arm_name(kv: str, path: str) -> str:
    """`arm_name("int8", "fused")` → `"int8/fused"`."""
    return f"{kv}/{path}"


def parse_arm(arm: str) -> tuple[str, str]:
    """`"int4/unfused"` → `("int4", "unfused")`; a bare format means the fused path."""
    kv, _, path = arm.partition("/")
    path = path or "fused"
    if path not in PATHS:
        raise SchemaError(f"arm {arm!r}: path {path!r} is not one of {', '.join(PATHS)}")
    return kv, path


def make_cell_id(params: Mapping[str, Any]) -> str:
    """A stable, readable id for one cell: same params → same id (resume relies on it).

    Readable head (kind, model, arm, context, rep, warm-up) plus a short hash of every
    param, so two configs that differ only in, say, chunk size never collide.
    """
    head = "|".join(
        [
            str(params.get("kind", "bench")),
            str(params.get("model", "")),
            str(params.get("arm", "")),
            f"c{params.get('context', '')}",
            ("w" if params.get("warmup") else "r") + str(params.get("rep", 0)),
        ]
    )
    blob = json.dumps(dict(params), sort_keys=True, default=str).encode()
    return f"{head}|{hashlib.sha1(blob).hexdigest()[:8]}"


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def base_row(
    cell: Mapping[str, Any],
    *,
    run_id: str,
    device: str,
    git_commit: str | None,
) -> dict[str, Any]:
    """Common keys filled from a planned cell; status starts as "error" until set.

    `cell` carries at least cell_id, kind, seq, order_seed, rep, warmup, model, kv, path,
    context (plan.Cell.to_dict() does).
    """
    kind = cell.get("kind", "bench")
    row: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "run_id": run_id,
        "cell_id": cell["cell_id"],
        "kind": kind,
        "seq": int(cell["seq"]),
        "order_seed": int(cell["order_seed"]),
        "rep": int(cell["rep"]),
        "warmup": bool(cell["warmup"]),
        "model": str(cell["model"]),
        "arm": arm_name(cell["kv"], cell["path"]),
        "kv": str(cell["kv"]),
        "path": str(cell["path"]),
        "context": int(cell["context"]),
        "chunk_size": cell.get("chunk_size"),
        "decode_tokens": cell.get("decode_tokens"),
        "status": "error",
        "phase": None,
        "error": None,
        "timestamp": utc_now(),
        "device": device,
        "git_commit": git_commit,
        "engine": str(cell.get("engine") or "kvtax"),
    }
    if kind == "bench":
        row.update({k: None for k in BENCH_KEYS})
        row["presized"] = bool(cell.get("presize", False))
        row["quantized_kv_start"] = int(cell.get("quantized_kv_start", 0))
    return row


def row_problems(row: Mapping[str, Any]) -> list[str]:
    """Every way `row` departs from the schema (empty list: valid)."""
    problems = []
    specs = dict(COMMON_KEYS)
    kind = row.get("kind")
    if kind not in KINDS:
        problems.append(f"kind {kind!r} is not one of {KINDS}")
    # Kind-specific keys are required only on successful rows: a failed cell measured nothing.
    if row.get("status") == "ok":
        specs.update(KIND_KEYS.get(str(kind), {}))
    for key, types in specs.items():
        if key not in row:
            problems.append(f"missing key {key!r}")
            continue
        val = row[key]
        if val is None:
            if None not in types:
                problems.append(f"{key!r} is null")
            continue
        ok = tuple(t for t in types if t is not None)
        # bool is an int subclass in Python; keep the two apart.
        if isinstance(val, bool) and bool not in ok:
            problems.append(f"{key!r} is a bool, expected {ok}")
        elif not isinstance(val, ok):
            problems.append(f"{key!r} has type {type(val).__name__}, expected {ok}")
    if row.get("schema") not in (None, SCHEMA_VERSION) and "schema" in row:
        problems.append(f"schema {row.get('schema')!r} != {SCHEMA_VERSION}")
    if row.get("status") not in STATUSES:
        problems.append(f"status {row.get('status')!r} is not one of {STATUSES}")
    if row.get("engine", "kvtax") == "kvtax" and row.get("path") not in PATHS:
        problems.append(f"path {row.get('path')!r} is not one of {PATHS}")
    if row.get("status") not in ("ok", "unavailable") and not row.get("error"):
        problems.append("a failed row must say why in 'error'")
    return problems


def validate_row(row: Mapping[str, Any]) -> None:
    """Raise SchemaError listing every problem with `row`."""
    problems = row_problems(row)
    if problems:
        raise SchemaError(f"row {row.get('cell_id', '?')}: " + "; ".join(problems))
