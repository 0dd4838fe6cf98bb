"""A small HTTP client for OpenAI-compatible servers (stdlib only): JSON requests,
server-sent-event streams, and the tokenizer endpoints servers expose.

    >>> client = Client("http://127.0.0.1:8001", timeout_s=60)
    >>> client.get("/v1/models")["data"][0]["id"]
    >>> for event in client.stream("/v1/completions", {"prompt": "Hi", "stream": True}):
    ...     event["choices"][0]["text"]
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from kvtax.errors import KVTaxError


class ServerError(KVTaxError):
    """The server answered with an HTTP error, or could not be reached."""


class Client:
    """One server at `url` (http:// or https://, an optional path prefix such as /v1 is
    stripped: endpoints are given in full)."""

    def __init__(self, url: str, timeout_s: float = 120.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise KVTaxError(f"server url {url!r} must look like http://HOST:PORT")
        self.url, self.scheme = url, parts.scheme
        self.host, self.port = parts.hostname, parts.port or (443 if parts.scheme == "https"
                                                              else 80)
        self.prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self._open: http.client.HTTPConnection | None = None

    def _conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout_s)

    def _send(self, method: str, path: str, body: dict | None) -> tuple[Any, Any]:
        conn = self._conn()
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data else {}
        try:
            conn.request(method, self.prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
        except OSError as e:
            conn.close()
            raise ServerError(f"server {self.url} unreachable ({path}): {e}") from None
        if resp.status >= 400:
            text = resp.read(400).decode("utf-8", "replace").strip()
            conn.close()
            raise ServerError(f"server {self.url}{path}: HTTP {resp.status} {text}")
        return conn, resp

    def get(self, path: str) -> Any:
        """GET `path` → parsed JSON."""
        conn, resp = self._send("GET", path, None)
        try:
            return json.loads(resp.read())
        finally:
            conn.close()

    def post(self, path: str, body: dict) -> Any:
        """POST JSON `body` to `path` → parsed JSON."""
        conn, resp = self._send("POST", path, body)
        try:
            return json.loads(resp.read())
        finally:
            conn.close()

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """POST `body` and yield each server-sent event's JSON `data` until `[DONE]` or
        the stream ends. Closing the generator closes the connection (the server then
        stops generating)."""
        conn, resp = self._send("POST", path, body)
        self._open = conn
        try:
            data: list[str] = []
            for raw in resp:
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith("data:"):
                    data.append(line[5:].lstrip())
                    continue
                if line or not data:  # comments (": ping"), event:/id: fields
                    continue
                payload, data = "\n".join(data), []
                if payload == "[DONE]":
                    return
                event = json.loads(payload)
                if "error" in event:
                    raise ServerError(f"server {self.url}{path}: {event['error']}")
                yield event
        finally:
            conn.close()
            self._open = None


# Tokenizer endpoints, tried in order: (tokenize path, body maker, detokenize path).
# llama.cpp's server and vLLM serve /tokenize; llama-cpp-python's server /extras/tokenize.
TOKENIZERS = (
    ("/tokenize", lambda text, model: {"content": text, "add_special": True},
     "/detokenize"),
    ("/tokenize", lambda text, model: {"model": model, "prompt": text}, "/detokenize"),
    ("/extras/tokenize", lambda text, model: {"model": model, "input": text},
     "/extras/detokenize"),
)


class ServerTokenizer:
    """The server's own tokenizer, found by probing `TOKENIZERS`; `found` False when the
    server has none (token counts are then approximate)."""

    def __init__(self, client: Client, model: str) -> None:
        self.client, self.model = client, model
        self.endpoint: tuple | None = None
        for entry in TOKENIZERS:
            try:
                tokens = client.post(entry[0], entry[1]("Hello world", model)).get("tokens")
            except (ServerError, ValueError, AttributeError):
                continue
            if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
                self.endpoint = entry
                break

    @property
    def found(self) -> bool:
        return self.endpoint is not None

    @property
    def name(self) -> str | None:
        return self.endpoint[0] if self.endpoint else None

    def encode(self, text: str) -> list[int]:
        """Token ids the server gives `text` (special tokens as the server adds them)."""
        assert self.endpoint is not None
        return list(self.client.post(self.endpoint[0],
                                     self.endpoint[1](text, self.model))["tokens"])

    def decode(self, ids: list[int]) -> str:
        assert self.endpoint is not None
        out = self.client.post(self.endpoint[2], {"model": self.model, "tokens": list(ids)})
        return str(out.get("text", out.get("content", out.get("prompt", ""))))
