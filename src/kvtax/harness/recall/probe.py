"""`kvtax recall`: planted-fact recall per KV format and context, one row per question.

For each context, N facts (`recall.facts`) are planted at depths spread over a filler
document grown to exactly that many tokens (`recall.transcript`); the model is asked for
each fact in its own generation (greedy, a budget that fits the answer, stop at the end of
the answer's line or EOS), and the answer is graded by the planted value. Arms run in
order with the unquantized baseline first, so its accuracy is on disk before any format is
compared with it. Rows (kind "recall") go to a run folder like every harness measurement.

    >>> cfg = RecallConfig(model="tiny", contexts=[512], kvs=["fp16", "int8"], facts=4)
    >>> run_dir = run_recall(cfg, root="runs")
"""

from __future__ import annotations

import hashlib
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtax.harness.kv_arm import parse_arm
from kvtax.errors import KVTaxError
from kvtax.harness.recall.facts import Fact, grade, make_facts
from kvtax.harness.recall.models import RecallModel, Unavailable, load_recall_model
from kvtax.harness.recall.transcript import (
    FillerStream,
    build_prompts,
    filler_paragraphs,
    min_context,
    spread_depths,
)
from kvtax.harness.schema import base_row, make_cell_id, utc_now, validate_row
from kvtax.harness.store import RunStore, environment, git_commit

BASELINES = ("fp16", "bf16", "fp32")
# What a recall config.json must hold to be resumed: the keys that define its questions.
RESUME_KEYS = ("model", "contexts", "kvs", "facts", "seed")
ANSWER_SLACK = 8  # tokens beyond the fact's own sentence: room for "The answer is" etc.


class RecallInputError(KVTaxError, ValueError):
    """A recall run cannot start (e.g. a context too short for the frame and facts)."""


@dataclass
class RecallConfig:
    """Everything that defines a recall run; stored as config.json in the run folder."""

    model: str = "tiny"
    contexts: list[int] = field(default_factory=lambda: [1024, 2048])
    kvs: list[str] = field(default_factory=lambda: ["fp16", "int8", "int4"])
    facts: int = 8
    seed: int = 0
    filler: str | None = None          # a text file; None: pydoc_data/topics.py prose
    engine: str = "auto"               # auto | kvtax | hf, or an engine (--engine NAME)
    engine_options: dict[str, Any] = field(default_factory=dict)  # another engine's extras
    device: str = "cpu"
    dtype: str = "float32"
    chunk_size: int = 2048
    sliding_kv: str | None = None
    max_new_tokens: int | None = None  # None: the fact's sentence + ANSWER_SLACK tokens
    chat: bool = True                  # apply the tokenizer's chat template when it has one
    command: str = ""
    kind: str = "recall"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ordered_arms(arms: list[tuple[str, str]],
                 first: tuple[str, str] | None = None) -> list[tuple[str, str]]:
    """(kv, path) arms with the unquantized one(s) first, the rest in the order given;
    `first`: another engine's baseline arm (its own names), put before all."""
    if first is not None and first in arms:
        return [first] + [a for a in arms if a != first]
    base = [a for a in arms if a[0].lower() in BASELINES and a[1] in ("fp16", "fused")]
    base.sort(key=lambda a: a[1] != "fp16")  # transformers' own cache before kvtax fp16
    return base + [a for a in arms if a not in base]


def model_label(source: str) -> str:
    """What rows call the model: a file or folder's name, else the name as given."""
    p = Path(source).expanduser()
    return p.name if p.exists() else source


def _cell(cfg: RecallConfig, model: RecallModel, kv: str, path: str, ctx: int, q: int,
          seq: int) -> dict:
    params = {
        "kind": "recall", "model": model_label(cfg.model), "arm": f"{kv}/{path}", "context": ctx,
        "rep": 0, "warmup": False, "fact_index": q, "facts": cfg.facts, "seed": cfg.seed,
        "filler": cfg.filler, "chunk_size": cfg.chunk_size, "chat": cfg.chat,
        "sliding_kv": cfg.sliding_kv, "engine": model.engine,
    }
    return {"cell_id": make_cell_id(params), "kv": kv, "path": path, "seq": seq,
            "order_seed": cfg.seed, **params}


def recall_row(cell: dict, run_id: str, device: str, commit: str | None) -> dict[str, Any]:
    """A recall row with every common key; the outcome keys are filled by the caller."""
    row = base_row(cell, run_id=run_id, device=device, git_commit=commit)
    row.update(fact_index=cell["fact_index"], depth=0.0, expected="", answer=None, correct=None)
    return row


def _fitted(model: RecallModel, kvs: list[str]) -> list[str]:
    """`kvs` with each format named without a group size given one dividing the model's
    head_dim, so rows name what is stored ("int8" → "int8-g32" at 96)."""
    head_dim = getattr(getattr(getattr(model, "model", None), "config", None), "head_dim", None)
    if not isinstance(head_dim, int):
        return kvs
    return [parse_arm(kv).fit(head_dim).name for kv in kvs]


def run_recall(
    cfg: RecallConfig,
    root: str | Path = "runs",
    *,
    name: str = "recall",
    resume: str | Path | None = None,
    model: RecallModel | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Run the grid arms x contexts x facts; return the run folder (rows.jsonl inside).

    `resume` reopens a run folder and skips questions that already have a row. `model`
    reuses a loaded model (tests); otherwise `cfg.model` is loaded once for all arms.
    """
    store = None
    if resume is not None:
        store = RunStore.open(resume, kind="recall", required=RESUME_KEYS)
        cfg = RecallConfig(**{k: v for k, v in store.config().items()
                              if k in RecallConfig.__dataclass_fields__})
    # Model and contexts first: a bad model or a too-short context leaves no run folder.
    if model is None:
        t = time.perf_counter()
        model = _load(cfg)
        log(f"loaded {cfg.model} ({model.engine} engine) in {time.perf_counter() - t:.1f} s")
    check_contexts(cfg, model)
    paragraphs = filler_paragraphs(cfg.filler)
    if store is None:
        store = RunStore.create(root, name, cfg.to_dict())
    # the default filler is this Python's pydoc prose, which differs between releases: two
    # runs ask the same questions only where this matches
    filler_sha = hashlib.sha256("\n\n".join(paragraphs).encode("utf-8")).hexdigest()
    store.write_env({**environment(cfg.device), "filler_sha256": filler_sha})
    commit = git_commit()
    log(f"kvtax recall: run folder {store.path}")
    log(f"kvtax recall: filler {cfg.filler or 'pydoc_data/topics.py (this Python)'}, "
        f"sha256 {filler_sha[:12]}")
    facts = make_facts(cfg.facts, cfg.seed)
    depths = spread_depths(cfg.facts)
    filler = FillerStream(model.tokenizer, paragraphs)
    budgets = [cfg.max_new_tokens or len(model.tokenizer.encode(f.statement)) + ANSWER_SLACK
               for f in facts]
    done = store.done_cell_ids()
    resolved = [model.resolve(a) for a in _fitted(model, cfg.kvs)]
    arms = ordered_arms(resolved, getattr(model, "first_arm", lambda _a: None)(resolved))
    version = getattr(model, "version", None)
    total = len(arms) * len(cfg.contexts) * len(facts)
    seq, t_start, n_run = 0, time.perf_counter(), 0
    for kv, path in arms:
        for ctx in cfg.contexts:
            cells = []
            for q in range(len(facts)):
                cells.append(_cell(cfg, model, kv, path, ctx, q, seq))
                seq += 1
            todo = [c for c in cells if c["cell_id"] not in done]
            if not todo:
                continue
            right = 0
            ask = _Asker(model, filler, facts, depths, budgets, kv, path, ctx, cfg)
            for cell in todo:
                q = cell["fact_index"]
                row = recall_row(cell, store.run_id, cfg.device, commit)
                if version:
                    row["engine_version"] = version
                ask(row, q)
                validate_row(row)
                store.append(row)
                n_run += 1
                right += bool(row["correct"])
                eta = (time.perf_counter() - t_start) / n_run * (total - cell["seq"] - 1)
                log(f"[{cell['seq'] + 1}/{total}] {row['arm']} ctx {ctx} fact {q} depth "
                    f"{row['depth']:.2f}: {_mark(row)} expected {facts[q].value!r} got "
                    f"{row['answer']!r}  (ETA {eta:.0f} s)")
            log(f"== {kv}/{path} @ {ctx}: {right}/{len(todo)} correct")
    getattr(model, "close", lambda: None)()
    return store.path


def check_contexts(cfg: RecallConfig, model: RecallModel) -> None:
    """Raise RecallInputError when a context cannot hold the frame and the facts."""
    facts = make_facts(cfg.facts, cfg.seed)
    need = min_context(model.tokenizer, facts, cfg.chat)
    short = [c for c in cfg.contexts if c < need]
    if short:
        raise RecallInputError(
            f"context {min(short)} is too short for {cfg.facts} facts: the question frame and "
            f"the facts take {need} tokens with this tokenizer; use --contexts of at least "
            f"{need} (or fewer --facts)"
        )


def _load(cfg: RecallConfig) -> Any:
    """kvtax's runner or a transformers model (engine auto / kvtax / hf), else the
    engine named `cfg.engine` through the engine interface."""
    if cfg.engine in ("auto", "kvtax", "hf"):
        return load_recall_model(
            cfg.model, engine=cfg.engine, dtype=cfg.dtype, device=cfg.device,
            chunk_size=cfg.chunk_size, sliding_kv=cfg.sliding_kv, seed=cfg.seed,
        )
    from kvtax.harness.recall.engine import EngineRecallModel

    return EngineRecallModel(cfg)


def _mark(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"].upper()
    return "right" if row["correct"] else "WRONG"


class _Asker:
    """Asks the questions of one (arm, context): prompts built and the document prefilled
    once; any failure becomes the row's status and the run goes on."""

    def __init__(self, model: RecallModel, filler: FillerStream, facts: list[Fact],
                 depths: list[float], budgets: list[int], kv: str, path: str, ctx: int,
                 cfg: RecallConfig):
        self.model, self.facts, self.depths, self.budgets = model, facts, depths, budgets
        self.kv, self.session = kv, None
        self.setup_error: BaseException | None = None
        try:
            self.prompts = build_prompts(model.tokenizer, filler, facts, depths, ctx,
                                         use_chat=cfg.chat)
            shared = self.prompts[0].shared
            self.session = model.session(kv, path, self.prompts[0].ids[:shared],
                                         ctx + max(budgets))
        except Exception as exc:  # noqa: BLE001 - reported on every question's row
            self.setup_error = exc

    def __call__(self, row: dict, q: int) -> None:
        row["expected"] = self.facts[q].value
        row["depth"] = float(self.depths[q])
        try:
            if self.setup_error is not None:
                row["phase"] = "setup"
                raise self.setup_error
            assert self.session is not None
            prompt = self.prompts[q]
            row["depth"] = float(prompt.depths[q])
            tokens = self.session.ask(prompt.ids[prompt.shared:], self.budgets[q])
            text = self.model.tokenizer.decode(tokens)
            row["answer"] = answer_text(text)
            row["correct"] = grade(row["answer"], self.facts[q].value)
            row["status"] = "ok"
        except Unavailable as exc:
            row["status"], row["error"] = "unavailable", str(exc)
        except Exception as exc:  # noqa: BLE001 - a failed question is a row, the run goes on
            row["status"] = "oom" if _is_oom(exc) else "error"
            row["phase"] = row["phase"] or (self.session.phase if self.session else "setup")
            row["error"] = f"{type(exc).__name__}: {exc}"
            if row["status"] == "error":  # on the row, not the terminal: one per question
                row["traceback"] = traceback.format_exc()[-4000:]
        row["timestamp"] = utc_now()


def answer_text(text: str) -> str:
    """The answer as graded and stored: the generated text up to the line that gave a value
    (the stop rule), surrounding whitespace removed."""
    lines = text.strip().split("\n")
    for n, line in enumerate(lines):
        if any(c.isdigit() for c in line):
            return "\n".join(lines[:n + 1]).strip()
    return text.strip()


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc)
