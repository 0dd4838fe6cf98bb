"""Engines the harness measures: kvtax's runner, transformers, llama.cpp, mlx-lm, and
any OpenAI-compatible server. One interface (`base.Engine`), one module each."""

from kvtax.harness.engines.base import (
    ENGINES,
    Engine,
    EngineSpec,
    EngineUnavailable,
    MemoryCounter,
    get_engine,
    require_engine,
)

__all__ = ["ENGINES", "Engine", "EngineSpec", "EngineUnavailable", "MemoryCounter",
           "get_engine", "require_engine"]
