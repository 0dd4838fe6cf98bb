"""A torch-free engine marked `isolated`, for the child-process plumbing's tests.

Tokens are characters (id = code point); `generate` echoes the prompt's text back one
token at a time; logits are a fixed function of the position. `spec.options` play the
failures an isolated engine must report: `refuse` (EngineUnavailable in load), `crash`
(SIGSEGV in load), `sleep` (seconds load blocks), and `bad_kv` for a kv the constructor
rejects. The child imports it as `tests.support.echo_engine`, so the repository root must
be on the child's PYTHONPATH.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import numpy as np

from kvtax.errors import KVTaxError
from kvtax.harness.engines import Engine, EngineSpec, EngineUnavailable


class EchoEngine(Engine):
    name = "echo"
    isolated = True

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        if spec.kv == "bad_kv":
            raise KVTaxError(f"echo: unknown kv {spec.kv!r}; use f16")
        self.loaded = False

    @classmethod
    def arms(cls, kvs: list[str], paths: list[str]) -> list[tuple[str, str]]:
        return [(kv, p) for kv in kvs for p in paths]

    def version(self) -> str:
        return f"echo {os.getpid()}"

    def load(self) -> None:
        opts = self.spec.options
        if opts.get("refuse"):
            raise EngineUnavailable(f"echo refused arm {self.spec.kv}/{self.spec.path}: "
                                    f"{opts['refuse']}")
        if opts.get("crash"):
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(float(opts.get("sleep", 0)))
        self.loaded = True

    def prompt_ids(self, n: int, seed: int) -> list[int]:
        return [97 + (seed + i) % 26 for i in range(n)]

    def prefill(self, ids: list[int]) -> None:
        raise EngineUnavailable("echo does not prefill")

    def decode(self, n: int) -> list[float]:
        raise EngineUnavailable("echo does not decode")

    def memory_counter(self) -> Any:
        raise EngineUnavailable("echo counts no memory")

    def info(self) -> dict[str, Any]:
        return {"loaded": self.loaded, "torch_imported": "torch" in sys.modules}

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def prefix_ids(self) -> list[int]:
        return [2]

    def generate(self, ids: list[int], max_new_tokens: int, stop: Any = None) -> list[int]:
        new: list[int] = []
        for tok in ids[:max_new_tokens]:
            new.append(tok)
            if stop is not None and stop(self.detokenize(new)):
                break
        return new

    def logits(self, ids: list[int], tail: int) -> Any:
        if not 0 < tail < len(ids):
            raise ValueError(f"tail {tail} must be in 1..{len(ids) - 1}")
        pos = np.arange(len(ids) - tail, len(ids), dtype=np.float32)[:, None]
        return np.sin(pos * np.arange(1, 17, dtype=np.float32)[None, :])


ENGINE = EchoEngine
