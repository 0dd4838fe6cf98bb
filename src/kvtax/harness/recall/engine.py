"""`kvtax recall --engine NAME`: the recall probe asked through any Engine.

`EngineRecallModel` is what `run_recall` questions (the interface of
`recall.models.RecallModel`: `resolve`, `session(...).ask`, `tokenizer`), built on
`Engine.generate` (greedy, stopping at the end of the answer's line) and
`Engine.tokenize` / `detokenize`. Prompts are token-exact in the engine's own tokens;
an engine that has a `render_chat(text)` method (the chat template around one user
message) and `prefix_ids()` (its BOS) gets the same chat framing as kvtax's runner.

Each arm ("KV" or "KV/PATH", the engine's own names) loads the engine once, with room
for the longest context plus the answer budget, and asks every question from a fresh
cache (no prefix reuse: engines keep their caches to themselves). The first arm loaded
(the engine's baseline) also gives the tokenizer. An engine marked `isolated` (llama.cpp)
runs in a child process that never imports torch (`engines.process.open_engine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtax.harness.engines import Engine, EngineSpec, require_engine
from kvtax.harness.engines.process import open_engine
from kvtax.harness.kv_arm import parse_arm
from kvtax.harness.recall.models import stop_after_line

ANSWER_ROOM = 256  # tokens past the longest context an arm's cache must hold


class EngineTextTokenizer:
    """An engine's tokenizer as recall's TextTokenizer (encode, decode, chat framing);
    `current()` gives the engine loaded now (every arm runs the same model)."""

    eos_token_id = None  # the engine stops at its own EOS inside generate()

    def __init__(self, current: Any) -> None:
        self.current = current

    @property
    def engine(self) -> Engine:
        return self.current()

    def encode(self, text: str) -> list[int]:
        return list(self.engine.tokenize(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.engine.detokenize(list(ids))

    def prefix_ids(self) -> list[int]:
        return list(getattr(self.engine, "prefix_ids", lambda: [])())

    def render_chat(self, user_text: str) -> str | None:
        render = getattr(self.engine, "render_chat", None)
        return render(user_text) if render else None


class EngineSession:
    """Questions after one shared prefix on one arm: each a fresh `generate`."""

    def __init__(self, engine: Engine, prefix: list[int]) -> None:
        self.engine, self.prefix, self.phase = engine, list(prefix), "setup"

    def ask(self, suffix: list[int], budget: int) -> list[int]:
        """The answer's token ids to prefix + `suffix`."""
        self.phase = "decode"  # generate() prefills and decodes; the error text tells which
        return list(self.engine.generate(self.prefix + list(suffix), budget,
                                         stop=stop_after_line))


class EngineRecallModel:
    """An engine's arms for `run_recall` (see the module docstring)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg, self.engine = cfg, str(cfg.engine)
        self.cls = require_engine(self.engine)
        self.label = str(cfg.model)
        self.arms = [self.resolve(a) for a in cfg.kvs]
        self.base = self.cls.baseline_arm(self.arms) or self.arms[0]
        self.live: tuple[tuple[str, str], Engine] | None = None
        self.tokenizer = EngineTextTokenizer(self.current)
        self.version = self.current().version()

    def current(self) -> Engine:
        """The engine loaded now (the baseline arm's when none is)."""
        return self.live[1] if self.live is not None else self._engine(self.base)

    def resolve(self, arm: str) -> tuple[str, str]:
        """(kv, path) of "KV[/PATH]" (the engine's default path when none is given);
        KVTaxError (one line) for a name the engine does not know."""
        parsed = parse_arm(arm)
        kv, path = parsed.cache, parsed.path or self.cls.default_paths()[0]
        if not self.cls.arms([kv], [path]):
            raise ValueError(f"engine {self.engine} has no arm {arm!r}")
        return kv, path

    def first_arm(self, arms: list[tuple[str, str]]) -> tuple[str, str] | None:
        """The arm asked first: the engine's baseline (its unquantized cache)."""
        return self.cls.baseline_arm(arms)

    def _engine(self, arm: tuple[str, str]) -> Engine:
        """The loaded engine of `arm` (one arm is loaded at a time)."""
        if self.live is not None and self.live[0] == arm:
            return self.live[1]
        self.close()
        c = self.cfg
        spec = EngineSpec(model=c.model, kv=arm[0], path=arm[1], device=c.device,
                          dtype=c.dtype, seed=c.seed, chunk_size=c.chunk_size,
                          capacity=max(c.contexts) + (c.max_new_tokens or ANSWER_ROOM),
                          options=dict(getattr(c, "engine_options", None) or {}))
        engine = open_engine(self.cls, spec)
        try:
            engine.load()
        except BaseException:
            engine.close()  # an isolated engine's process ends here, not at exit
            raise
        self.live = (arm, engine)
        return engine

    def session(self, kv: str, path: str, prefix: list[int], capacity: int) -> EngineSession:
        """Questions that all start with `prefix`, on arm kv/path."""
        return EngineSession(self._engine((kv, path)), prefix)

    def close(self) -> None:
        """Free the loaded arm's engine (a later question loads it again)."""
        if self.live is not None:
            self.live[1].close()
            self.live = None
