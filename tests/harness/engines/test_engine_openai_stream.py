"""The openai engine's stream handling against a scripted local SSE server (stdlib only,
127.0.0.1): comments and pings, several tokens a chunk with the server's usage, a stream
that ends early, HTTP errors, --url parsing, and the pid-from-port lookup.

The end-to-end check against a real server is tests/harness/engines/test_engine_openai.py."""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from kvtax.errors import KVTaxError
from kvtax.harness.engines.base import EngineSpec, EngineUnavailable
from kvtax.harness.engines.openai import OpenAIEngine
from kvtax.harness.engines.openai_http import ServerError
from kvtax.harness.engines import server_memory
from kvtax.harness.engines.server_memory import pid_for_port


def _chunk(text: str) -> dict:
    return {"choices": [{"text": text, "index": 0, "finish_reason": None}]}


class Script:
    """What the fake server streams for /v1/completions, and what it was sent."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.bodies: list[dict] = []


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *_a: object) -> None:
            pass

        def _json(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                return self._json(200, {"data": [{"id": "fake-model"}]})
            self._json(404, {"error": "no"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            script.bodies.append(body)
            if self.path != "/v1/completions":
                return self._json(404, {"error": "no such endpoint"})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for raw in script.events:
                self.wfile.write(raw.encode())
                self.wfile.flush()

    return H


@pytest.fixture
def fake() -> Iterator[tuple[Script, str]]:
    script = Script()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield script, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _engine(url: str, capacity: int | None = None, **options: object) -> OpenAIEngine:
    eng = OpenAIEngine(EngineSpec(model="fake", kv="f16", path="server", capacity=capacity,
                                  options={"url": url, "timeout_s": 10, **options}))
    eng.load()
    return eng


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def test_stream_counts_chunks_and_reads_usage(fake: tuple[Script, str]) -> None:
    """Pings, field lines and empty role chunks are not tokens; data lines of one event
    join (the SSE rule); usage (5 tokens in 4 chunks) gives ms/token; the request asks
    for greedy, EOS-free, usage-reporting output."""
    script, url = fake
    script.events = [": ping\n\n", _sse({"choices": [{"text": "", "index": 0}]}),
                     _sse(_chunk("A")), _sse(_chunk(" b")), "event: x\n" + _sse(_chunk(" cd")),
                     # one event's JSON over two data lines, an id field between them
                     'data: {"choices": [{"text": " e",\nid: 7\ndata: "index": 0}]}\n\n',
                     _sse({"choices": [{"text": "", "finish_reason": "length"}],
                           "usage": {"prompt_tokens": 5, "completion_tokens": 5}}),
                     _sse("[DONE]")]
    eng = _engine(url, capacity=6 + 4)
    assert eng.facts["prompt_tokens_approx"] is True  # the fake has no tokenizer
    ids = eng.prompt_ids(6, seed=1)
    assert len(ids) == 6 and eng.detokenize(ids).split() == eng._text(ids).split()
    eng.prefill(ids)
    assert len(eng.decode(1)) == 1 and eng._stream is not None  # the settle step
    ms = eng.decode(2)
    assert eng._stream is None  # all 4 asked tokens came: drained to [DONE]
    body = script.bodies[-1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["ignore_eos"] and body["min_tokens"] == 4
    assert body["model"] == "fake-model" and len(body["prompt"].split()) == 6
    info = eng.info()
    assert len(ms) == 2 and all(m >= 0 for m in ms)
    assert info["stream_chunks"] == 4 and info["completion_tokens"] == 5
    assert info["finish_reason"] == "length" and info["prompt_tokens_server"] == 5
    span = eng._t_last - eng._t_first
    assert info["decode_ms_per_token_usage"] == pytest.approx(span * 1e3 / 4)


def test_stream_ending_early_is_an_error(fake: tuple[Script, str]) -> None:
    script, url = fake
    script.events = [_sse(_chunk("A")), _sse(_chunk("B")), _sse("[DONE]")]
    eng = _engine(url, capacity=4 + 8)
    eng.prefill(eng.prompt_ids(4, seed=0))
    with pytest.raises(KVTaxError, match="ended the stream after 2 chunks"):
        eng.decode(5)


def test_server_error_event_and_http_error(fake: tuple[Script, str]) -> None:
    script, url = fake
    script.events = [_sse({"error": {"message": "context too long"}})]
    eng = _engine(url)
    with pytest.raises(ServerError, match="context too long"):
        eng.prefill(eng.prompt_ids(4, seed=0))
    with pytest.raises(ServerError, match="HTTP 404"):
        eng.client.post("/nope", {})


def test_unreachable_server_is_one_line() -> None:
    eng = OpenAIEngine(EngineSpec(model="m", kv="q8", path="server",
                                  options={"url": "http://127.0.0.1:9", "timeout_s": 2}))
    with pytest.raises(ServerError, match="unreachable"):
        eng.load()


def test_arms_and_urls() -> None:
    arms = OpenAIEngine.arms(["q8", "f16"], ["server"])
    assert arms == [("q8", "server"), ("f16", "server")]
    assert OpenAIEngine.baseline_arm(arms) == ("f16", "server")
    with pytest.raises(KVTaxError, match="one path"):
        OpenAIEngine.arms(["q8"], ["fused"])
    with pytest.raises(KVTaxError, match="--url"):
        OpenAIEngine.arms([], ["server"])
    spec = EngineSpec(model="m", kv="q8", path="server", options={"urls": {"f16": "http://x:1"}})
    with pytest.raises(KVTaxError, match="--url q8="):
        OpenAIEngine(spec)
    with pytest.raises(KVTaxError, match="HOST:PORT"):
        OpenAIEngine(EngineSpec(model="m", kv="q8", path="server",
                                options={"urls": {"q8": "ftp://x:1"}}))


def test_pid_for_port_finds_this_process(fake: tuple[Script, str]) -> None:
    _, url = fake
    port = int(url.rsplit(":", 1)[1])
    assert pid_for_port(port) == os.getpid()
    eng = _engine(url)
    counter = eng.memory_counter()
    assert counter.kind == "server_rss" and eng.facts["server_pid"] == os.getpid()
    counter.reset()
    assert counter.peak() >= counter.current() > 0


def test_nvml_counter_reads_the_servers_processes(monkeypatch, fake: tuple[Script, str]) -> None:
    """GPU bytes of the server's pid summed over GPUs (a stand-in pynvml: no GPU here);
    without pynvml the option is one line naming the package."""
    _, url = fake
    used = {"bytes": 1 << 30}

    def procs(handle: int) -> list:
        return [SimpleNamespace(pid=os.getpid(), usedGpuMemory=used["bytes"] * (handle + 1)),
                SimpleNamespace(pid=1, usedGpuMemory=5 << 30)]

    nvml = SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
                           nvmlDeviceGetHandleByIndex=lambda i: i,
                           nvmlDeviceGetComputeRunningProcesses=procs)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    counter = _engine(url, nvml=True).memory_counter()
    assert counter.kind == "nvml_process"
    counter.reset()
    used["bytes"] = 2 << 30
    assert counter.current() == 3 * (2 << 30)
    time.sleep(0.1)  # the sampling thread polls every 10 ms
    used["bytes"] = 1 << 30
    assert counter.peak() == 3 * (2 << 30)
    counter.close()
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(EngineUnavailable, match="pip install nvidia-ml-py"):
        _engine(url, nvml=True).memory_counter()


def test_server_rss_samples_where_the_peak_cannot_be_reset(monkeypatch) -> None:
    """Without clear_refs (another user's server) a thread samples VmRSS: a 64 MiB
    buffer touched inside the phase shows in its peak."""
    monkeypatch.setattr(server_memory, "_reset_hwm", lambda pid: False)
    counter = server_memory.ServerRSS(os.getpid(), interval_s=0.001)
    assert counter.kind == "server_rss_sampled"
    counter.reset()
    start = counter.current()
    buf = mmap.mmap(-1, 64 << 20)  # fresh pages (reused heap memory would not raise RSS)
    buf[::4096] = b"\1" * len(range(0, 64 << 20, 4096))  # every page resident
    deadline = time.monotonic() + 10  # the thread's samples, not peak()'s own reading:
    while (counter._sampled or 0) - start < 60 << 20 and time.monotonic() < deadline:
        time.sleep(0.005)  # a loaded machine may run the sampler late; wait for it
    buf.close()
    time.sleep(0.01)
    peak = counter.peak()
    counter.close()
    assert peak - start >= 60 << 20
