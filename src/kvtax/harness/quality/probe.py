"""`kvtax quality`: next-token quality of quantized KV against the fp16-KV run, per context.

For each context c the text's first c + 1 tokens are run teacher-forced, in chunks
through the caches (one forward per KV format, never one per position): first with fp16
KV, keeping the log-probabilities of the last N positions, then once per format. Each
format's row holds, over those N positions, mean KL(fp16 || format), top-1 agreement
and perplexity (and perplexity over all c positions), the deltas against fp16, and each
layer's relative attention-output error on the run's own K/V (`quality.metrics`). Rows
(kind "quality") are fsynced to a run folder like every harness measurement.

    >>> cfg = QualityConfig(model="tiny", contexts=[256], kvs=["int8", "int4+hk"])
    >>> run_dir = run_quality(cfg, root="runs")
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtax.cache import SlidingCache, make_caches
from kvtax.errors import KVTaxError
from kvtax.formats.hybrid import fit_kv_name
from kvtax.harness.kv_arm import parse_arm
from kvtax.harness.quality.metrics import (
    LayerErrorProbe,
    TailStats,
    ppl_deltas,
    kl_divergence,
    log_probs,
    nll,
    top1_agree,
)
from kvtax.harness.recall.probe import model_label
from kvtax.harness.recall.models import RecallModel, load_recall_model
from kvtax.harness.schema import base_row, make_cell_id, utc_now, validate_row
from kvtax.harness.store import RunStore, environment, git_commit

PROGRESS_EVERY_S = 15.0


@dataclass
class QualityConfig:
    """Everything that defines a quality run; stored as config.json in the run folder."""

    model: str = "tiny"
    contexts: list[int] = field(default_factory=lambda: [512, 2048])
    kvs: list[str] = field(default_factory=lambda: ["int8", "int8+hk", "int4", "int4+hk"])
    tail: int = 128                 # scored positions: the last `tail` of each context
    text: str | None = None         # a text file; None: pydoc_data/topics.py prose
    baseline: str = "fp16"
    sliding_kv: str | None = None   # format of sliding-window layers (None: the arm's)
    device: str = "cpu"
    dtype: str = "float32"
    chunk_size: int = 256
    seed: int = 0
    command: str = ""
    kind: str = "quality"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# What a quality config.json must hold to be resumed: the keys that define its cells.
RESUME_KEYS = ("model", "contexts", "kvs", "baseline", "tail")


class QualityInputError(KVTaxError, ValueError):
    """A quality run cannot start: bad contexts, tail, text or format. The message says why."""


def check_config(cfg: QualityConfig) -> None:
    """Raise QualityInputError (or FormatError) before any model is loaded."""
    if not cfg.contexts or any(c < 2 for c in cfg.contexts):
        raise QualityInputError(f"contexts must be integers >= 2, got {cfg.contexts}")
    if cfg.tail < 1:
        raise QualityInputError(f"--tail must be >= 1, got {cfg.tail}")
    if cfg.tail > min(cfg.contexts):
        raise QualityInputError(
            f"--tail {cfg.tail} exceeds the smallest context {min(cfg.contexts)}; the scored "
            "positions are the last N of each context"
        )
    if cfg.chunk_size < 1:
        raise QualityInputError(f"--chunk-size must be >= 1, got {cfg.chunk_size}")
    if cfg.text is not None and not Path(cfg.text).is_file():
        raise QualityInputError(f"--text {cfg.text}: no such file")
    for kv in [cfg.baseline, *cfg.kvs] + ([cfg.sliding_kv] if cfg.sliding_kv else []):
        arm = parse_arm(kv)
        arm.specs()  # FormatError names the valid formats
        if arm.path is not None:
            raise QualityInputError(f"{kv!r}: quality arms name a cache, no /PATH (the "
                                    "kvtax engine reads it through the fused kernels)")
    if not parse_arm(cfg.baseline).is_plain:
        raise QualityInputError("the baseline must be a plain format (fp16, bf16, fp32)")


def text_of(path: str | None) -> str:
    """The file's text, or the prose paragraphs of CPython's pydoc_data/topics.py: this
    Python's, or those of a topics.py file given as `path` (`default_prose`)."""
    from kvtax.harness.recall.transcript import default_prose

    paras = default_prose(path)
    if paras is not None:
        return "\n\n".join(paras)
    return Path(path).read_text(encoding="utf-8", errors="replace")


def text_ids(tok: Any, text: str, n: int) -> list[int]:
    """The first `n` token ids of `text` (after the tokenizer's BOS, if it adds one).

    Encodes a growing prefix of the text rather than all of it (700 KB by default).
    """
    prefix = list(getattr(tok, "prefix_ids", lambda: [])())
    chars = max(4 * n, 4096)
    while True:
        ids = prefix + list(tok.encode(text[:chars]))
        if len(ids) > n + 8 or chars >= len(text):  # + 8: the cut's last tokens may differ
            break
        chars *= 2
    if len(ids) < n:
        raise QualityInputError(
            f"the text has {len(ids)} tokens but a context of {n - 1} needs {n} (context + 1 "
            "target); pass a longer --text or smaller --contexts"
        )
    return ids[:n]


def text_fingerprint(text: str, ids: list[int]) -> dict[str, Any]:
    """sha256 of the text and of its scored token ids, for env.json: the default text is
    CPython's pydoc_data/topics.py, which differs between Python releases (3.11 vs 3.12:
    fp16 perplexity 7.39 vs 7.49 on Qwen2.5-Coder-0.5B at 8k), so two runs compare only
    where these match."""
    return {
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "text_tokens": len(ids),
        "token_ids_sha256": hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest(),
    }


def resident_nbytes(cache: Any) -> int:
    """K/V bytes the layer holds for decoding after this prefill: a sliding layer's last
    `window` tokens (and sinks), not the extra ring slots a prefill chunk needed."""
    if isinstance(cache, SlidingCache) and cache.store is not None:
        s = cache.store
        held = min(cache.length, cache.sinks) + min(cache.ring_tokens, cache.window)
        return held * s.batch * s.num_kv_heads * cache.spec.bytes_per_token(s.head_dim, s.dtype)
    return int(cache.used_nbytes)


@torch.no_grad()
def score_pass(
    model: Any,
    caches: list[Any],
    ids: torch.Tensor,
    *,
    chunk: int,
    tail: int,
    ref_logp: torch.Tensor | None = None,
    probe: LayerErrorProbe | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[TailStats, torch.Tensor | None]:
    """Teacher-forced pass of `ids` `[1, c + 1]` (inputs c tokens, targets shifted by one).

    Returns the tail statistics and, when `ref_logp` is None (the baseline pass), the
    tail's log-probabilities `[tail, V]` float32 to compare later passes with.
    """
    c = ids.shape[1] - 1
    inputs, targets = ids[:, :c], ids[0, 1:]
    dev = model.embed.weight.device
    tail_start = c - tail
    stats, kept = TailStats(), []
    handed = probe.tee(caches) if probe is not None else caches
    for s in range(0, c, chunk):
        e = min(s + chunk, c)
        pos = torch.arange(s, e, device=dev)
        logits = model(inputs[:, s:e].to(dev), handed, pos, last_only=False)[0].float()
        tgt = targets[s:e].to(dev)
        token_nll = nll(logits, tgt)
        stats.full_nll_sum += float(token_nll.sum())
        stats.full_count += e - s
        lo = max(0, tail_start - s)
        if lo < e - s:
            logp = log_probs(logits[lo:])
            stats.tail_nll += token_nll[lo:].tolist()
            if ref_logp is None:
                kept.append(logp)
            else:
                ref = ref_logp[s + lo - tail_start: e - tail_start]
                stats.kl += kl_divergence(ref, logp).tolist()
                stats.agree += top1_agree(ref, logp).tolist()
        if progress is not None:
            progress(e)
    if ref_logp is None:
        ref = torch.cat(kept)
        stats.kl, stats.agree = [0.0] * tail, [True] * tail
        return stats, ref
    return stats, None


def _cell(cfg: QualityConfig, kv: str, ctx: int, seq: int) -> dict[str, Any]:
    params = {
        "kind": "quality", "model": model_label(cfg.model), "arm": f"{kv}/fused", "context": ctx,
        "rep": 0, "warmup": False, "tail": cfg.tail, "text": cfg.text, "baseline": cfg.baseline,
        "sliding_kv": cfg.sliding_kv, "chunk_size": cfg.chunk_size, "dtype": cfg.dtype,
    }
    return {"cell_id": make_cell_id(params), "kv": kv, "path": "fused", "seq": seq,
            "order_seed": cfg.seed, **params}


def run_quality(
    cfg: QualityConfig,
    root: str | Path = "runs",
    *,
    name: str = "quality",
    resume: str | Path | None = None,
    model: RecallModel | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Run every context x format; return the run folder (rows.jsonl inside).

    `resume` reopens a run folder and skips cells that have a row (a context's fp16 pass
    reruns when any of its formats is still to do). `model` reuses a loaded model.
    """
    store = None
    if resume is not None:
        store = RunStore.open(resume, kind="quality", required=RESUME_KEYS)
        cfg = QualityConfig(**{k: v for k, v in store.config().items()
                               if k in QualityConfig.__dataclass_fields__})
    check_config(cfg)
    # Model and text first: a bad --model or a short --text leaves no empty run folder.
    if model is None:
        t = time.perf_counter()
        log(f"kvtax quality: loading {cfg.model}")
        model = load_recall_model(cfg.model, engine="kvtax", dtype=cfg.dtype, device=cfg.device,
                                  chunk_size=cfg.chunk_size, seed=cfg.seed)
        log(f"loaded in {time.perf_counter() - t:.1f} s")
    net = model.model
    windows = net.config.layer_windows()
    # names without a group size take one dividing head_dim (int8 → int8-g32 at 96)
    hd = net.config.head_dim
    cfg = dataclasses.replace(cfg, baseline=fit_kv_name(cfg.baseline, hd),
                              kvs=[parse_arm(kv).fit(hd).name for kv in cfg.kvs],
                              sliding_kv=cfg.sliding_kv and fit_kv_name(cfg.sliding_kv, hd))
    for kv in [cfg.baseline, *cfg.kvs]:  # every arm checked before the first cell runs
        parse_arm(kv).check(hd, len(windows))
    longest = max(cfg.contexts)
    if longest > net.config.max_position_embeddings:
        log(f"warning: context {longest} exceeds the model's trained length "
            f"{net.config.max_position_embeddings}")
    text = text_of(cfg.text)
    all_ids = text_ids(model.tokenizer, text, longest + 1)
    if store is None:
        store = RunStore.create(root, name, cfg.to_dict())
    fp = text_fingerprint(text, all_ids)
    store.write_env({**environment(cfg.device), **fp})
    log(f"kvtax quality: run folder {store.path}")
    log(f"kvtax quality: text {cfg.text or 'pydoc_data/topics.py (this Python)'}, "
        f"{fp['text_tokens']} tokens, token ids sha256 {fp['token_ids_sha256'][:12]}")
    done, commit = store.done_cell_ids(), git_commit()
    kvs = [cfg.baseline] + [k for k in cfg.kvs if k != cfg.baseline]
    for i, ctx in enumerate(sorted(cfg.contexts)):
        cells = [_cell(cfg, kv, ctx, i * len(kvs) + j) for j, kv in enumerate(kvs)]
        if not all(c["cell_id"] in done for c in cells):
            _run_context(net, torch.tensor([all_ids[: ctx + 1]]), cells, cfg, store, done,
                         commit, log)
    return store.path


def _run_context(net: Any, ids: torch.Tensor, cells: list[dict[str, Any]], cfg: QualityConfig,
                 store: RunStore, done: set[str], commit: str | None,
                 log: Callable[[str], None]) -> None:
    """The cells of one context `ids` `[1, c + 1]`: the baseline's pass first (its
    log-probabilities are what every format is compared with), then each format's; each
    cell's row appended unless the run folder has it."""
    ref_logp, base = None, None
    for cell in cells:
        kv, ctx = cell["kv"], cell["context"]
        is_base = kv == cfg.baseline
        if not is_base and ref_logp is None:
            break  # the baseline failed: nothing to compare with
        if not is_base and cell["cell_id"] in done:
            continue
        row = base_row(cell, run_id=store.run_id, device=cfg.device, git_commit=commit)
        try:
            measured, logp = measure(net, ids, kv, cfg, ref_logp, _progress(log, kv, ctx))
            if is_base:
                ref_logp, base = logp, measured
            row.update(measured, **ppl_deltas(measured, base), status="ok")
        except Exception as exc:  # noqa: BLE001 - a failed cell is a row, the run goes on
            oom = isinstance(exc, (MemoryError, torch.OutOfMemoryError))
            row.update(status="oom" if oom else "error", phase="prefill",
                       error=f"{type(exc).__name__}: {exc}")
            row["traceback"] = traceback.format_exc()[-4000:]  # the row, not the terminal
        row["timestamp"] = utc_now()
        validate_row(row)
        if cell["cell_id"] not in done:
            store.append(row)
        log(_line(row))


def measure(
    net: Any,
    ids: torch.Tensor,
    kv: str,
    cfg: QualityConfig,
    ref_logp: torch.Tensor | None,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """One teacher-forced pass of `ids` `[1, c + 1]` over `kv` caches: the row's measured
    fields, and the tail log-probabilities when this is the baseline (`ref_logp` None)."""
    t0 = time.perf_counter()
    windows = net.config.layer_windows()
    is_base = ref_logp is None
    c = ids.shape[1] - 1
    arm = parse_arm(kv)  # hybrid and per-layer caches come from the one factory
    caches = make_caches(windows, arm.base, sliding_spec=arm.sliding(cfg.sliding_kv),
                         overrides=arm.layers, max_chunk=cfg.chunk_size)
    # fp16 shadows of this pass's own K/V give each layer's attention error.
    shadows = None if is_base else make_caches(windows, cfg.baseline, max_chunk=cfg.chunk_size)
    probe = LayerErrorProbe(net, shadows, c - cfg.tail)
    with probe:
        stats, logp = score_pass(net, caches, ids, chunk=cfg.chunk_size, tail=cfg.tail,
                                 ref_logp=ref_logp, probe=probe, progress=progress)
    row = stats.summary()
    row.update(
        tail=cfg.tail, baseline=cfg.baseline, layer_windows=windows,
        layer_specs=[c.spec.name for c in caches],  # what each layer stored (q4: per window)
        layer_attn_rel_err=None if is_base else probe.layer_errors(),
        head_attn_rel_err=None if is_base else probe.head_errors(),
        cache_bytes=sum(resident_nbytes(c) for c in caches),
        seconds=time.perf_counter() - t0,
    )
    return row, logp


def _progress(log: Callable[[str], None], kv: str, ctx: int) -> Callable[[int], None]:
    t0 = [time.perf_counter(), time.perf_counter()]

    def tick(done: int) -> None:
        now = time.perf_counter()
        if now - t0[1] >= PROGRESS_EVERY_S and done < ctx:
            t0[1] = now
            eta = (now - t0[0]) / done * (ctx - done)
            log(f"  {kv} @ {ctx}: {done}/{ctx} tokens (ETA {eta:.0f} s)")

    return tick


def _line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"== {row['kv']} @ {row['context']}: {row['status'].upper()} {row['error']}"
    errs = [(e, i) for i, e in enumerate(row.get("layer_attn_rel_err") or []) if e is not None]
    worst = ""
    if errs:
        e, i = max(errs)
        worst = f", worst layer {i} attn err {e:.3g}"
    return (f"== {row['kv']} @ {row['context']}: KL {row['kl']:.3g}, top-1 {row['top1']:.3f}, "
            f"ppl {row['ppl']:.4g} (delta {row['ppl_delta']:+.3g}){worst} "
            f"[{row['seconds']:.1f} s]")
