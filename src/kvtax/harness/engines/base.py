"""The engine interface: what the harness needs from any stack it measures.

An engine knows how to run a model — load it, prefill a prompt, decode greedy tokens,
count its own memory, give logits where it has them — and nothing about sweeps,
statistics or reports. The harness (bench cells, recall, quality) drives it; each engine
lives in its own module of this package and is looked up by name (`get_engine`).

Arms: every engine names its arms as (kv, path) pairs, like kvtax's own, so rows, stats
and reports stay one format (`arm = "<kv>/<path>"`):

| engine       | kv (cache setting)                          | path (how attention runs)       |
|--------------|---------------------------------------------|---------------------------------|
| kvtax        | fp16, int8, int4, fp8, k8v4, ...            | fused, fp16, unfused, dequant   |
| transformers | dynamic, static, quanto-int4, hqq-int4, kvtax-int8, ... | eager, compiled     |
| llama.cpp    | f16, q8_0, q4_0, q8_0:q4_0 (K:V, like llama-bench's -ctk/-ctv) | fa, nofa  |
| mlx-lm       | fp16, q8, q4, q4-g32 (QuantizedKVCache bits / group) | default, presized      |
| openai       | the server's arm name the user gave (--url NAME=URL) | server                 |

Lifecycle inside one worker process (one cell):

    eng = get_engine("llama.cpp")(EngineSpec(model=..., kv="q8_0", path="fa", ...))
    eng.load()                       # setup phase: weights, context, caches
    ids = eng.prompt_ids(4096, seed) # a prompt of exactly that many tokens
    eng.prefill(ids)                 # TTFT: the prompt through the model, first token out
    ms = eng.decode(32)              # 32 greedy steps (EOS ignored), ms per token each
    eng.close()

Memory: `eng.memory_counter()` returns the engine's own counter (mlx: `mx.get_peak_memory`,
CUDA: allocated bytes, CPU: process RSS, a server: its pid's RSS or NVML); the harness
resets it at each phase start and reads the phase's peak at its end.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from kvtax.errors import KVTaxError


class EngineUnavailable(KVTaxError):
    """The engine's package is missing (the message names the install command) or the
    engine cannot run this arm here (the message says why)."""


class MemoryCounter(Protocol):
    """An engine's own memory counter, reset per phase (`kind` names what it counts)."""

    kind: str  # e.g. "cuda_allocated", "cpu_rss", "mlx_peak", "server_rss"

    def reset(self) -> None:
        """Start a phase: the peak becomes the current level."""

    def current(self) -> int | None:
        """Bytes in use now (None: not measurable)."""

    def peak(self) -> int | None:
        """Peak bytes since the last reset (None: not measurable)."""


@dataclass
class EngineSpec:
    """One arm of one engine on one model, as a cell gives it to the engine."""

    model: str                      # built-in name, HF folder, hub id, .gguf file, URL...
    kv: str                         # the engine's own cache setting (see the table above)
    path: str                       # the engine's own attention path
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    threads: int | None = None
    chunk_size: int = 2048          # prefill chunk (llama.cpp n_batch, mlx prefill_step_size)
    capacity: int | None = None     # tokens the cache must hold (prompt + decode), if known
    options: dict[str, Any] = field(default_factory=dict)  # engine-specific extras


class Engine(ABC):
    """Base class of every engine. Subclasses set the class attributes and implement
    the abstract methods; the optional ones raise EngineUnavailable by default."""

    name: ClassVar[str]             # "--engine NAME"
    modules: ClassVar[tuple[str, ...]] = ()  # import names it needs (checked without import)
    install: ClassVar[str] = ""     # e.g. "pip install 'kvtax[llamacpp]'"
    # True: `kvtax quality` and `kvtax recall` run it in a child process that never imports
    # torch (engines.process); its module and everything it imports must not import torch.
    isolated: ClassVar[bool] = False

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec

    # ---- checks the parent process can make without importing the engine's packages

    @classmethod
    def missing(cls) -> str | None:
        """One line naming the install command when a needed package is absent, else None."""
        absent = [m for m in cls.modules if importlib.util.find_spec(m) is None]
        if not absent:
            return None
        return (f"engine {cls.name} needs {', '.join(absent)}, which is not installed: "
                f"{cls.install}")

    @classmethod
    @abstractmethod
    def arms(cls, kvs: list[str], paths: list[str]) -> list[tuple[str, str]]:
        """The (kv, path) arms of a sweep; raises KVTaxError (one line) for a bad name."""

    @staticmethod
    def checked_product(engine: str, kvs: list[str], paths: list[str], parse: Any,
                        known_paths: tuple[str, ...]) -> list[tuple[str, str]]:
        """kvs x paths after `parse(kv)` accepted every kv (it raises KVTaxError) and every
        path is one of `known_paths` (else one KVTaxError line naming them)."""
        for kv in kvs:
            parse(kv)
        bad = [p for p in paths if p not in known_paths]
        if bad:
            raise KVTaxError(f"{engine} has no path {bad[0]!r}; use {', '.join(known_paths)}")
        return [(kv, p) for kv in kvs for p in paths]

    @classmethod
    def default_kvs(cls) -> list[str]:
        """--kv when the user gives none."""
        return ["fp16"]

    @classmethod
    def default_paths(cls) -> list[str]:
        """--paths when the user gives none."""
        return ["default"]

    @classmethod
    def baseline_arm(cls, arms: list[tuple[str, str]]) -> tuple[str, str] | None:
        """The arm the others are compared with (this engine's unquantized cache)."""
        return arms[0] if arms else None

    # ---- inside the worker

    @abstractmethod
    def version(self) -> str:
        """The engine's package version, e.g. "llama-cpp-python 0.3.36"."""

    @abstractmethod
    def load(self) -> None:
        """Setup phase: load the model and build the cache for `spec.kv` / `spec.path`."""

    @abstractmethod
    def prompt_ids(self, n: int, seed: int) -> list[int]:
        """Exactly `n` token ids for a bench prompt (seeded, valid for this model)."""

    @abstractmethod
    def prefill(self, ids: list[int]) -> None:
        """Run the prompt through the model, up to and including the first generated
        token (what TTFT measures). Leaves the engine ready to decode."""

    @abstractmethod
    def decode(self, n: int) -> list[float]:
        """`n` greedy steps after `prefill`, EOS ignored; wall ms of each step."""

    @abstractmethod
    def memory_counter(self) -> MemoryCounter:
        """The engine's own memory counter (see MemoryCounter)."""

    def cache_bytes(self) -> int | None:
        """Resident bytes of the KV cache after prefill, where the engine can say."""
        return None

    def bytes_per_token(self) -> int | None:
        """KV bytes one token adds across all layers, where the engine's format is known."""
        return None

    def info(self) -> dict[str, Any]:
        """Facts for the row: which attention path really ran (e.g. llama.cpp's flash
        attention fallback, mlx's fused SDPA or not), backend, compile mode..."""
        return {}

    def reset(self) -> None:
        """Forget the prompt (an empty cache) so another prefill can follow."""
        raise EngineUnavailable(f"engine {self.name} cannot reset its cache")

    def logprobs(self, ids: list[int], tail: int) -> Any:
        """Teacher-forced log-probabilities of the last `tail` positions of `ids`
        (row i predicts ids[len(ids) - tail + i]): a float32 torch tensor [tail, vocab].
        By default the log-softmax of `logits`."""
        return log_softmax(self.logits(ids, tail))

    def logits(self, ids: list[int], tail: int) -> Any:
        """The logits behind `logprobs`, without torch: a float32 numpy array [tail, vocab]
        (an engine that runs isolated gives these; its parent takes the log-softmax)."""
        raise EngineUnavailable(f"engine {self.name} gives no logits")

    def generate(self, ids: list[int], max_new_tokens: int,
                 stop: Any = None) -> list[int]:
        """Greedy generation after prompt `ids` (a fresh cache); `stop(text) -> bool`
        ends it early. Returns the new token ids."""
        raise EngineUnavailable(f"engine {self.name} cannot generate")

    def tokenize(self, text: str) -> list[int]:
        raise EngineUnavailable(f"engine {self.name} has no tokenizer")

    def detokenize(self, ids: list[int]) -> str:
        raise EngineUnavailable(f"engine {self.name} has no tokenizer")

    def close(self) -> None:
        """Free what load() took."""


def log_softmax(logits: Any) -> Any:
    """Float32 numpy logits [tail, vocab] -> float32 torch log-probabilities [tail, vocab]."""
    import torch

    return torch.log_softmax(torch.from_numpy(logits).float(), dim=-1)


# Engine name -> module defining it (imported only when asked for).
ENGINES: dict[str, str] = {
    "kvtax": "kvtax.harness.engines.kvtax_engine",
    "transformers": "kvtax.harness.engines.transformers_engine",
    "llama.cpp": "kvtax.harness.engines.llamacpp",
    "mlx-lm": "kvtax.harness.engines.mlxlm",
    "openai": "kvtax.harness.engines.openai",
}


# Engines outside kvtax register a module (defining ENGINE) under this entry-point group.
ENTRY_POINTS = "kvtax.engines"


def _plugins() -> dict[str, str]:
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}


def get_engine(name: str) -> type[Engine]:
    """The Engine subclass named `name` (raises KVTaxError naming the choices).

    Built-in engines are in ENGINES; a package can add one with an entry point in the
    group "kvtax.engines" (`name = "package.module"`, the module defining ENGINE)."""
    modules = ENGINES if name in ENGINES else _plugins()
    if name not in modules:
        choices = ", ".join(dict.fromkeys([*ENGINES, *_plugins()]))
        raise KVTaxError(f"unknown engine {name!r}; choose from {choices}")
    module = importlib.import_module(modules[name])
    engine = getattr(module, "ENGINE")
    assert issubclass(engine, Engine) and engine.name == name
    return engine


def require_engine(name: str) -> type[Engine]:
    """`get_engine(name)` whose packages are installed, else EngineUnavailable (one line
    naming the install command): what a command checks before it runs anything."""
    try:
        engine = get_engine(name)
    except ImportError as exc:  # the engine's own module is absent from this kvtax
        raise EngineUnavailable(f"engine {name} is not part of this kvtax install ({exc})") \
            from None
    why = engine.missing()
    if why:
        raise EngineUnavailable(why)
    return engine
