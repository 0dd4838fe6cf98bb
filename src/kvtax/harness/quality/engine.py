"""`kvtax quality --engine NAME`: next-token quality of an engine's cache settings against
the same engine's unquantized arm, on the same text.

For each arm (the engine's baseline first) the engine is loaded once; for each context c
it scores the text's first c + 1 tokens teacher-forced (`Engine.logprobs`, the last
`tail` positions). Each row holds, against the baseline arm at the same context, mean
KL(baseline || arm) in nats (max, median, standard error), top-1 agreement, and the
perplexity of the text's real next tokens and its delta — the metrics of
`harness.quality.probe` (shared through `quality.metrics`), so formats compare across engines
on one model. What an engine cannot give (per-layer attention error, perplexity over
all positions) is left null. Rows are kind "quality", fsynced, resumable. An engine marked
`isolated` (llama.cpp) runs in a child process that never imports torch and hands back
numpy logits; the log-softmax and every metric are computed here.

    >>> cfg = QualityConfig(model="m.gguf", contexts=[512], kvs=["f16", "q8_0", "q4_0"])
    >>> run_engine_quality(cfg, EngineQuality("llama.cpp", paths=["fa"]), root="runs")
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtax.harness.engines import Engine, EngineSpec, require_engine
from kvtax.harness.engines.process import open_engine
from kvtax.harness.quality.metrics import ppl_deltas
from kvtax.harness.quality.probe import (
    QualityConfig,
    QualityInputError,
    text_fingerprint,
    text_ids,
    text_of,
)
from kvtax.harness.quality.metrics import TailStats, kl_divergence, top1_agree
from kvtax.harness.recall.probe import model_label
from kvtax.harness.schema import arm_name, base_row, make_cell_id, utc_now, validate_row
from kvtax.harness.store import RunStore, environment, git_commit


@dataclass
class EngineQuality:
    """Which engine and its settings: paths (default: the engine's), threads, options."""

    engine: str
    paths: list[str] = field(default_factory=list)
    threads: int | None = None
    options: dict[str, Any] = field(default_factory=dict)


class EngineText:
    """An engine's tokenizer seen as the `encode` / `prefix_ids` pair `text_ids` reads."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    def prefix_ids(self) -> list[int]:
        return list(getattr(self.engine, "prefix_ids", lambda: [])())


def engine_arms(cfg: QualityConfig, eq: EngineQuality) -> list[tuple[str, str]]:
    """The engine's arms, its baseline first (the others are compared with it)."""
    cls = require_engine(eq.engine)
    kvs = list(dict.fromkeys([cfg.baseline, *cfg.kvs] if cfg.baseline else cfg.kvs))
    arms = cls.arms(kvs, eq.paths or cls.default_paths())
    base = cls.baseline_arm(arms)
    if base is None:
        raise QualityInputError(f"engine {eq.engine}: no baseline arm among {arms}")
    return [base] + [a for a in arms if a != base]


def _cell(cfg: QualityConfig, eq: EngineQuality, arm: tuple[str, str], ctx: int,
          seq: int) -> dict[str, Any]:
    params = {
        "kind": "quality", "model": model_label(cfg.model), "arm": arm_name(*arm),
        "context": ctx, "rep": 0, "warmup": False, "tail": cfg.tail, "text": cfg.text,
        "baseline": cfg.baseline, "chunk_size": cfg.chunk_size, "dtype": cfg.dtype,
        "engine": eq.engine, "engine_options": eq.options,
    }
    return {"cell_id": make_cell_id(params), "kv": arm[0], "path": arm[1], "seq": seq,
            "order_seed": cfg.seed, **params}


def score(logp: torch.Tensor, targets: list[int], ref: torch.Tensor | None) -> TailStats:
    """Tail statistics of log-probabilities `[tail, V]` for `targets` (`[tail]` ids),
    against the baseline's `ref` `[tail, V]` (None: this is the baseline)."""
    t = torch.tensor(targets)
    stats = TailStats()
    stats.tail_nll = (-logp.double().gather(-1, t.view(-1, 1)).squeeze(-1)).tolist()
    if ref is None:
        stats.kl, stats.agree = [0.0] * len(targets), [True] * len(targets)
    else:
        stats.kl = kl_divergence(ref, logp).tolist()
        stats.agree = top1_agree(ref, logp).tolist()
    return stats


def run_engine_quality(
    cfg: QualityConfig,
    eq: EngineQuality,
    root: str | Path = "runs",
    *,
    name: str = "quality",
    resume: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Every arm x context on `eq.engine`; returns the run folder (rows.jsonl inside).

    `resume` skips cells with a row; the baseline arm reruns (without a new row) for the
    contexts whose other arms are still to do."""
    arms = engine_arms(cfg, eq)  # a bad arm or a missing package: before any folder
    store = RunStore.open(resume) if resume else RunStore.create(
        root, name, dict(cfg.to_dict(), engine=eq.engine, engine_paths=eq.paths,
                         engine_threads=eq.threads, engine_options=eq.options))
    store.write_env(environment(cfg.device))
    commit, done = git_commit(), store.done_cell_ids()
    log(f"kvtax quality: run folder {store.path} (engine {eq.engine})")
    contexts = sorted(cfg.contexts)
    cells = {(a, c): _cell(cfg, eq, a, c, i * len(contexts) + j)
             for i, a in enumerate(arms) for j, c in enumerate(contexts)}
    need = [c for c in contexts if any(cells[(a, c)]["cell_id"] not in done for a in arms)]
    refs: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
    ids: list[int] | None = None
    for arm in arms:
        todo = [c for c in need if cells[(arm, c)]["cell_id"] not in done or arm == arms[0]]
        if not todo:
            continue
        engine = _engine(cfg, eq, arm, max(contexts) + 1)
        try:
            engine.load()
            version = engine.version()
            if ids is None:
                text = text_of(cfg.text)
                ids = text_ids(EngineText(engine), text, max(contexts) + 1)
                fp = text_fingerprint(text, ids)  # env.json: which text and tokens
                store.update_env(fp)
                log(f"kvtax quality: {fp['text_tokens']} tokens, token ids sha256 "
                    f"{fp['token_ids_sha256'][:12]}")
            for ctx in todo:
                cell = cells[(arm, ctx)]
                row = _measure(engine, cfg, cell, ids[: ctx + 1], refs, arm_name(*arms[0]))
                row.update(engine_version=version, run_id=store.run_id, git_commit=commit)
                if cell["cell_id"] not in done:
                    validate_row(row)
                    store.append(row)
                log(_line(row))
        finally:
            engine.close()
    return store.path


def _engine(cfg: QualityConfig, eq: EngineQuality, arm: tuple[str, str],
            capacity: int) -> Engine:
    spec = EngineSpec(model=cfg.model, kv=arm[0], path=arm[1], device=cfg.device,
                      dtype=cfg.dtype, seed=cfg.seed, threads=eq.threads,
                      chunk_size=cfg.chunk_size, capacity=capacity, options=dict(eq.options))
    return open_engine(require_engine(eq.engine), spec)


def _measure(engine: Engine, cfg: QualityConfig, cell: dict[str, Any], ids: list[int],
             refs: dict[int, tuple[torch.Tensor, dict[str, Any]]],
             base: str) -> dict[str, Any]:
    """One arm at one context as a row, against arm `base` (`refs`: its log-probabilities
    and row per context, filled when `cell` is the base); a failure becomes the status."""
    ctx, is_base = cell["context"], cell["arm"] == base
    row = base_row(cell, run_id="", device=cfg.device, git_commit=None)
    row["engine_spec"] = {"kv": cell["kv"], "path": cell["path"], "options": cell["engine_options"]}
    t0 = time.perf_counter()
    try:
        if not is_base and ctx not in refs:
            raise RuntimeError("the baseline arm failed at this context: nothing to compare")
        logp = engine.logprobs(ids, cfg.tail).float()
        if tuple(logp.shape[:1]) != (cfg.tail,):
            raise RuntimeError(f"engine gave logprobs of shape {tuple(logp.shape)}, "
                               f"expected [{cfg.tail}, vocab]")
        ref = None if is_base else refs[ctx][0]
        measured = score(logp, ids[len(ids) - cfg.tail:], ref).summary()
        measured.update(tail=cfg.tail, baseline=base,
                        cache_bytes=engine.cache_bytes(), seconds=time.perf_counter() - t0,
                        layer_attn_rel_err=None, head_attn_rel_err=None)
        if is_base:
            refs[ctx] = (logp, measured)
        row.update(measured, **ppl_deltas(measured, measured if is_base else refs[ctx][1]),
                   status="ok")
    except Exception as exc:  # noqa: BLE001 - a failed cell is a row, the run goes on
        oom = isinstance(exc, (MemoryError, torch.OutOfMemoryError))
        row.update(status="oom" if oom else "error", phase="prefill",
                   error=f"{type(exc).__name__}: {exc}")
        traceback.print_exc(file=sys.stderr)
    row["timestamp"] = utc_now()
    return row


def _line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"== {row['arm']} @ {row['context']}: {row['status'].upper()} {row['error']}"
    return (f"== {row['arm']} @ {row['context']}: KL {row['kl']:.3g}, top-1 "
            f"{row['top1']:.3f}, ppl {row['ppl']:.4g} "
            f"(delta {row['ppl_delta'] if row['ppl_delta'] is not None else 0:+.3g}) "
            f"[{row['seconds']:.1f} s]")
