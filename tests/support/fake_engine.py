"""A fake engine for the engine plumbing's tests: exact, predictable numbers, no real stack.

Registered through the "kvtax.engines" entry point by `tests/support/engine_env.py` (a throwaway
dist-info on PYTHONPATH), so `kvtax bench --engine fake` reaches it in fresh processes.
Its "package" is the module `kvtax_fake_backend`, which the same fixture writes (or leaves
out, to play a missing install).

Model: every token held costs `BPT[kv]` bytes in a counter (the memory counter reads it),
prefill also holds `SCRATCH` bytes per prompt token until it ends, and a decode step is *reported* to take `0.1 + 1e-5 * held * BPT[kv]` ms, so decode is
exactly linear in context with slopes in the ratio of bytes per token. Tokens are
characters (id = code point, capped at 127); `generate` answers a recall question from its
own prompt (q4 answers 0: a format that "forgets"); logits are a seeded function of the context, perturbed by
an amount that grows as the format's bits shrink. `--engine-option fail=KV:PHASE` raises
in that phase for that kv (PHASE: load, prefill, decode; decode: the timed window).
"""

from __future__ import annotations

import importlib
import random
import re
from typing import Any, ClassVar

from kvtax.errors import KVTaxError
from kvtax.harness.engines import Engine

BPT = {"f16": 64, "q8": 34, "q4": 18}   # bytes per token of each "cache type"
NOISE = {"f16": 0.0, "q8": 0.01, "q4": 0.2}
SCRATCH = 100  # transient bytes per prompt token during prefill (a scores buffer)
PATHS = ("a", "b")
VOCAB = 128


class FakeCounter:
    """Bytes the fake cache holds; peak since reset."""

    kind = "fake_bytes"

    def __init__(self) -> None:
        self.now = 0
        self.top = 0

    def add(self, n: int) -> None:
        self.now += n
        self.top = max(self.top, self.now)

    def reset(self) -> None:
        self.top = self.now

    def current(self) -> int | None:
        return self.now

    def peak(self) -> int | None:
        return self.top


class FakeEngine(Engine):
    name: ClassVar[str] = "fake"
    modules: ClassVar[tuple[str, ...]] = ("kvtax_fake_backend",)
    install: ClassVar[str] = "pip install kvtax-fake-backend"

    @classmethod
    def arms(cls, kvs: list[str], paths: list[str]) -> list[tuple[str, str]]:
        for kv in kvs:
            if kv not in BPT:
                raise KVTaxError(f"fake: unknown kv {kv!r}; choose from {', '.join(BPT)}")
        for p in paths:
            if p not in PATHS:
                raise KVTaxError(f"fake: unknown path {p!r}; choose from {', '.join(PATHS)}")
        return [(kv, p) for p in paths for kv in kvs]

    @classmethod
    def default_kvs(cls) -> list[str]:
        return ["f16", "q8"]

    @classmethod
    def default_paths(cls) -> list[str]:
        return ["a"]

    @classmethod
    def baseline_arm(cls, arms: list[tuple[str, str]]) -> tuple[str, str] | None:
        return next((a for a in arms if a[0] == "f16"), None)

    def _fail(self, phase: str) -> None:
        kv, _, where = str(self.spec.options.get("fail", "")).partition(":")
        if kv == self.spec.kv and where == phase:
            raise RuntimeError(f"fake engine failed in {phase} on purpose")

    def version(self) -> str:
        return f"kvtax-fake-backend {importlib.import_module('kvtax_fake_backend').VERSION}"

    def load(self) -> None:
        self._fail("load")
        self.counter = FakeCounter()
        self.held: list[int] = []

    def memory_counter(self) -> FakeCounter:
        return self.counter

    def prompt_ids(self, n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(32, VOCAB) for _ in range(n)]

    def prefill(self, ids: list[int]) -> None:
        self._fail("prefill")
        self.held += ids
        self.held.append(self._next())  # the first generated token (TTFT ends here)
        self.counter.add((len(ids) + 1) * BPT[self.spec.kv] + SCRATCH * len(ids))
        self.counter.add(-SCRATCH * len(ids))  # prefill's transient, freed before decode

    def _next(self) -> int:
        return 32 + sum(self.held[-4:]) % (VOCAB - 32)

    def decode(self, n: int) -> list[float]:
        if n > 1:  # the timed window, not the one-step warm-up or settle
            self._fail("decode")
        out = []
        for _ in range(n):
            out.append(0.1 + 1e-5 * len(self.held) * BPT[self.spec.kv])
            self.held.append(self._next())
            self.counter.add(BPT[self.spec.kv])
        return out

    def reset(self) -> None:
        self.counter.add(-len(self.held) * BPT[self.spec.kv])
        self.held = []

    def cache_bytes(self) -> int | None:
        return len(self.held) * BPT[self.spec.kv]

    def bytes_per_token(self) -> int | None:
        return BPT[self.spec.kv]

    def info(self) -> dict[str, Any]:
        return {"attention": f"fake-{self.spec.path}", "held": len(self.held)}

    def tokenize(self, text: str) -> list[int]:
        return [min(ord(c), VOCAB - 1) for c in text]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def logprobs(self, ids: list[int], tail: int) -> Any:
        import torch

        rows = []
        for i in range(len(ids) - tail, len(ids)):
            g = torch.Generator().manual_seed(hash(tuple(ids[max(0, i - 3):i])) % (1 << 31))
            logits = 3 * torch.randn(VOCAB, generator=g)
            n = torch.Generator().manual_seed(i)
            logits += NOISE[self.spec.kv] * 3 * torch.randn(VOCAB, generator=n)
            rows.append(torch.log_softmax(logits, -1))
        return torch.stack(rows).float()

    def generate(self, ids: list[int], max_new_tokens: int, stop: Any = None) -> list[int]:
        """Answers the prompt's last question with the value of the document sentence that
        shares most words with it; q4 "forgets" and answers 0."""
        value = "0" if self.spec.kv == "q4" else _lookup(self.detokenize(ids))
        out: list[int] = []
        for tok in self.tokenize(value + "\n"):
            out.append(tok)
            if len(out) >= max_new_tokens or (stop is not None and stop(self.detokenize(out))):
                break
        return out


def _lookup(prompt: str) -> str:
    """The value (number or code) of the sentence most like the prompt's last question."""
    question = prompt.rsplit("Question:", 1)[-1].split("\n")[0]
    words = set(re.findall(r"[a-z]+", question.lower()))
    best, value = -1, "?"
    for sentence in re.split(r"(?<=[.!?])\s+", prompt.rsplit("Question:", 1)[0]):
        found = re.search(r"\b(\d{1,3}(?:,\d{3})+|[A-Z]{2}-\d{4})\b", sentence)
        score = len(words & set(re.findall(r"[a-z]+", sentence.lower())))
        if found and score > best:
            best, value = score, found.group(1)
    return value


ENGINE = FakeEngine
