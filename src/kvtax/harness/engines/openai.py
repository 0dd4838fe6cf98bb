"""Any OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, mlx_lm.server,
llama-cpp-python's server) as an engine, over HTTP with the standard library.

One arm per server the user names: `--url f16=http://127.0.0.1:8001 --url
q8=http://127.0.0.1:8002` gives arms `f16/server` and `q8/server` (the user restarts or
runs one server per KV setting; kvtax never starts or manages servers). The arm's URL
reaches the engine as `spec.options["urls"][kv]` (or `spec.options["url"]`).

- prefill(ids): a streamed /v1/completions request (greedy, `ignore_eos` and
  `min_tokens` so the length is the one asked for, `stream_options.include_usage`);
  returns at the first generated token, so its wall time is TTFT.
- decode(n): consumes the same stream; each sample is the gap between two streamed
  chunks. info() adds the server's `usage.completion_tokens` and the ms per token over
  it, which differs from the samples' mean when a server sends several tokens a chunk.
- Prompts are sized with the server's tokenizer endpoint (/tokenize of llama.cpp and
  vLLM, /extras/tokenize of llama-cpp-python); without one they are words standing for
  tokens and info() says `prompt_tokens_approx: True`. Each prompt starts with two random
  words so a server's prefix cache cannot serve a repeated prompt.
- Memory: the server's RSS (`server_pid`, or the pid listening on the URL's port when
  the server is local), or its GPU memory through NVML (`nvml: True`, needs pynvml).
- generate(): recall through /v1/chat/completions (the server applies its template).
"""

from __future__ import annotations

import importlib.util
import random
import re
import time
from collections.abc import Iterator
from typing import Any

from kvtax.errors import KVTaxError
from kvtax.harness.engines.base import Engine, EngineSpec, EngineUnavailable
from kvtax.harness.engines.openai_http import Client, ServerError, ServerTokenizer
from kvtax.harness.engines.server_memory import NvmlCounter, ServerRSS, pid_for_port

PATH = "server"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
BASELINE_NAMES = ("f16", "fp16", "bf16", "auto")
DEFAULT_NEW_TOKENS = 128  # tokens asked for when the cell gives no capacity


def _words() -> list[str]:
    """English words from the standard library's pydoc topics (every Python has them)."""
    from pydoc_data.topics import topics

    return re.findall(r"[A-Za-z]{2,12}", " ".join(topics.values()))


class NoCounter:
    """No way to see the server's memory (remote, or pid not visible)."""

    kind = "none"

    def reset(self) -> None:
        pass

    def current(self) -> int | None:
        return None

    def peak(self) -> int | None:
        return None


class OpenAIEngine(Engine):
    """A running OpenAI-compatible server at the arm's URL (see the module doc)."""

    name = "openai"
    modules = ()  # standard library only
    install = "no package needed: start your server and pass --url NAME=http://HOST:PORT"

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        url = spec.options.get("url") or (spec.options.get("urls") or {}).get(spec.kv)
        if not url:
            raise KVTaxError(f"engine openai: no URL for arm {spec.kv!r}; pass --url "
                             f"{spec.kv}=http://HOST:PORT")
        self.client = Client(url, timeout_s=float(spec.options.get("timeout_s", 120)))
        self.api_model = ""
        self.tok: ServerTokenizer | None = None
        self._stream: Iterator[dict] | None = None
        self._texts: dict[tuple[int, ...], str] = {}
        self._words: list[str] = []
        self._distinct: list[str] = []
        self._vocab: dict[str, int] = {}
        self._last: tuple[list[int], str] = ([], "")
        self._head: list[int] = []
        self.facts: dict[str, Any] = {"url": url}

    # ---- planning (parent process)

    @classmethod
    def arms(cls, kvs: list[str], paths: list[str]) -> list[tuple[str, str]]:
        """One arm per named server (`kvs` are the --url names); the path is "server"."""
        if not kvs:
            raise KVTaxError("engine openai needs --url NAME=http://HOST:PORT (one per arm)")
        bad = [p for p in paths if p != PATH]
        if bad:
            raise KVTaxError(f"engine openai has one path, {PATH!r}, not {', '.join(bad)}")
        return [(kv, PATH) for kv in kvs]

    @classmethod
    def default_kvs(cls) -> list[str]:
        return []

    @classmethod
    def default_paths(cls) -> list[str]:
        return [PATH]

    @classmethod
    def baseline_arm(cls, arms: list[tuple[str, str]]) -> tuple[str, str] | None:
        """The arm named f16 / fp16 / bf16 / auto, else the first."""
        for arm in arms:
            if arm[0].lower() in BASELINE_NAMES:
                return arm
        return arms[0] if arms else None

    # ---- worker

    def version(self) -> str:
        """The server's own version where it says (vLLM /version, llama.cpp /props)."""
        for path, key in (("/version", "version"), ("/props", "build_info")):
            try:
                v = self.client.get(path).get(key)
            except (ServerError, ValueError, AttributeError):
                continue
            if v:
                return f"openai-server {v}"
        return "openai-server unknown"

    def load(self) -> None:
        """Reach the server, pick its model id, find its tokenizer endpoint."""
        models = self.client.get("/v1/models").get("data") or []
        ids = [m.get("id") for m in models if isinstance(m, dict)]
        if not ids:
            raise ServerError(f"server {self.client.url} lists no model at /v1/models")
        # --model picks among the served models; anything else means the first one.
        self.api_model = self.spec.model if self.spec.model in ids else str(ids[0])
        self.tok = ServerTokenizer(self.client, self.api_model)
        # What the server's tokenizer puts before any text (BOS), counted in prompts.
        self._head = self.tok.encode("") if self.tok.found else []
        self._words = _words()
        self._distinct = sorted(set(self._words))
        self.facts.update(api_model=self.api_model, tokenizer_endpoint=self.tok.name,
                          prompt_tokens_approx=not self.tok.found)

    def memory_counter(self) -> Any:
        """The server's RSS or NVML memory (see the module doc); NoCounter if unseen."""
        pid = self.spec.options.get("server_pid")
        if pid is None and self.client.host in LOCAL_HOSTS:
            pid = pid_for_port(self.client.port)
        self.facts["server_pid"] = pid
        if pid is None:
            return NoCounter()
        if self.spec.options.get("nvml"):
            if importlib.util.find_spec("pynvml") is None:
                raise EngineUnavailable("--engine-option nvml=true needs pynvml: "
                                        "pip install nvidia-ml-py")
            return NvmlCounter(int(pid))
        return ServerRSS(int(pid))

    def prompt_ids(self, n: int, seed: int) -> list[int]:
        """`n` tokens (the server's BOS, then seeded English in the server's tokenizer)
        after two random words."""
        rng = random.Random(seed)
        # Two of ~3,700 distinct words: the same pair twice is a 1-in-13-million event.
        words = [w.capitalize() for w in random.SystemRandom().sample(self._distinct, 2)]
        want = n - len(self._head)
        while True:
            words += [rng.choice(self._words) for _ in range(max(8, want))]
            body = self.tokenize(" ".join(words))
            if len(body) >= want:
                break
        text = self.detokenize(body[:want])
        ids = self._head + body[:want]
        self._texts[tuple(ids)] = text
        if self.tok is not None and self.tok.found:
            self.facts["prompt_tokens_exact"] = len(self.tok.encode(text)) == n
        return ids

    def tokenize(self, text: str) -> list[int]:
        """The server's token ids of `text` without its BOS (prefix_ids() has it), or,
        with no tokenizer endpoint, one id per whitespace-led word."""
        if self.tok is not None and self.tok.found:
            ids = self.tok.encode(text)
            return ids[len(self._head):] if ids[:len(self._head)] == self._head else ids
        return [self._vocab.setdefault(w, len(self._vocab))
                for w in re.findall(r"\s*\S+", text)]

    def prefix_ids(self) -> list[int]:
        """What the server's tokenizer puts before any text (its BOS, if any)."""
        return list(self._head)

    def detokenize(self, ids: list[int]) -> str:
        """Text of `ids` (a BOS among them contributes nothing)."""
        ids = list(ids)
        if ids[:len(self._head)] == self._head:
            ids = ids[len(self._head):]
        if ids == self._last[0]:
            return self._last[1]
        if self.tok is not None and self.tok.found:
            return self.tok.decode(ids)
        words = {i: w for w, i in self._vocab.items()}
        return "".join(words[i] for i in ids)

    # ---- running

    def _text(self, ids: list[int]) -> str:
        return self._texts.get(tuple(ids)) or self.detokenize(ids)

    def prefill(self, ids: list[int]) -> None:
        """Send the streamed completion; return when the first token arrives."""
        self.close_stream()
        cap = self.spec.capacity  # prompt + every token the cell will read
        max_tokens = cap - len(ids) if cap and cap > len(ids) else DEFAULT_NEW_TOKENS
        body = {"model": self.api_model, "prompt": self._text(ids), "max_tokens": max_tokens,
                "min_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        self._max_tokens, self._chunks, self._usage = max_tokens, 0, None
        self._finish, self._complete = None, False
        t0 = time.perf_counter()
        self._stream = self.client.stream("/v1/completions", body)
        self._t_first = self._next_token()
        self.facts["ttft_client_s"] = self._t_first - t0

    def _next_token(self) -> float:
        """Arrival time of the next chunk carrying text; KVTaxError if the stream ends."""
        assert self._stream is not None
        for event in self._stream:
            if event.get("usage"):
                self._usage = event["usage"]
            for choice in event.get("choices") or []:
                self._finish = choice.get("finish_reason") or self._finish
                if choice.get("text"):
                    self._chunks += 1
                    self._t_last = time.perf_counter()
                    return self._t_last
        self._stream, self._complete = None, True
        raise KVTaxError(f"server {self.client.url} ended the stream after {self._chunks} "
                         f"chunks (finish_reason {self._finish!r}, asked "
                         f"{self._max_tokens} tokens)")

    def decode(self, n: int) -> list[float]:
        """`n` more streamed chunks; ms between consecutive chunks. The stream stays
        open for the next call until every asked token has come."""
        if self._stream is None:
            raise KVTaxError("openai engine: decode() before prefill()")
        samples, last = [], self._t_last
        for _ in range(n):
            now = self._next_token()
            samples.append((now - last) * 1e3)
            last = now
        if self._chunks >= self._max_tokens:
            self._drain()  # what is left is the final usage chunk and [DONE]
        usage = self._usage or {}
        done = usage.get("completion_tokens")
        self.facts.update(stream_chunks=self._chunks, completion_tokens=done,
                          prompt_tokens_server=usage.get("prompt_tokens"),
                          finish_reason=self._finish)
        if done and done > 1 and self._complete:
            # Every token has arrived: first to last chunk spans done - 1 tokens.
            self.facts["decode_ms_per_token_usage"] = (
                (self._t_last - self._t_first) * 1e3 / (done - 1))
        return samples

    def _drain(self) -> None:
        try:
            while self._stream is not None:
                self._next_token()
        except KVTaxError:
            pass

    def reset(self) -> None:
        """Drop the current request (the server keeps no cache of ours to empty)."""
        self.close_stream()

    def close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()  # type: ignore[attr-defined]
            self._stream = None

    def generate(self, ids: list[int], max_new_tokens: int, stop: Any = None) -> list[int]:
        """Greedy chat completion with the prompt as the user's message; `stop(text)`
        closes the stream early. Returns the answer's token ids."""
        body = {"model": self.api_model, "temperature": 0.0, "stream": True,
                "max_tokens": int(max_new_tokens),
                "messages": [{"role": "user", "content": self._text(ids)}]}
        text = ""
        stream = self.client.stream("/v1/chat/completions", body)
        try:
            for event in stream:
                for choice in event.get("choices") or []:
                    text += (choice.get("delta") or {}).get("content") or ""
                if stop is not None and stop(text):
                    break
        finally:
            stream.close()  # type: ignore[attr-defined]
        new = self.tokenize(text)
        self._last = (new, text)
        return new

    def info(self) -> dict[str, Any]:
        """The server, how prompts were sized, and what the stream really carried."""
        return dict(self.facts, arm_as_requested=True)

    def close(self) -> None:
        self.close_stream()


ENGINE = OpenAIEngine
