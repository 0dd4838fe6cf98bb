"""An engine in a child process that never imports torch, driven from the parent.

`open_engine(cls, spec)` is how `kvtax quality` and `kvtax recall` make an engine: an
`EngineProcess` for an engine class marked `isolated` (llama.cpp), else `cls(spec)` in
process. A CUDA build of llama-cpp-python 0.3.36 segfaulted in model load in any process
that had imported torch 2.11 (H200, 2026-12-03); the parent here holds torch (it scores
log-probabilities), so llama.cpp runs next door (`python -m kvtax.harness.engines.isolated`).

The proxy has the Engine methods the probes use: `load`, `version`, `info`, `cache_bytes`,
`bytes_per_token`, `reset`, `tokenize`, `detokenize`, `generate` (its `stop` callback
runs here), `logprobs` (the child's numpy logits, log-softmaxed here), `close`, and
`prefix_ids` / `render_chat` where the engine has them. The child's exceptions are raised
again here as the same type with the same message; a child that dies becomes one
KVTaxError naming its exit signal. The child dies with the parent.

    >>> eng = open_engine(get_engine("llama.cpp"), EngineSpec(model="m.gguf", kv="q8_0",
    ...                                                      path="fa"))
    >>> eng.load(); lp = eng.logprobs(ids, 64); eng.close()   # lp: torch [64, vocab]
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvtax.errors import KVTaxError
from kvtax.harness.engines.base import Engine, EngineSpec, log_softmax

EXIT_WAIT_S = 30  # how long close() waits for the child to finish before killing it


def open_engine(cls: type[Engine], spec: EngineSpec) -> Any:
    """`cls(spec)`, in a torch-free child process when `cls.isolated`."""
    return EngineProcess(cls, spec) if cls.isolated else cls(spec)


def rebuild(module: str, qualname: str, args: tuple, message: str) -> Exception:
    """The child's exception as the same type and message, else a KVTaxError naming it."""
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if isinstance(cls, type) and issubclass(cls, Exception):
            exc = cls(*args)
            if str(exc) == message:
                return exc
    except Exception:  # noqa: BLE001 - a type that will not rebuild: name it instead
        pass
    return KVTaxError(f"{qualname}: {message}")


class EngineProcess:
    """`cls(spec)` in `python -m kvtax.harness.engines.isolated`; see the module docstring."""

    def __init__(self, cls: type[Engine], spec: EngineSpec) -> None:
        self.name, self.spec = cls.name, spec
        # The child imports the same kvtax as this process, wherever PYTHONPATH points.
        root = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtax.harness.engines.isolated", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )  # no preexec_fn: this process has torch's threads; the child sets PDEATHSIG
        try:
            self.facts: dict[str, Any] = self._request(("start", cls.__module__,
                                                        cls.__qualname__, spec), "start")
        except BaseException:
            self._end()
            raise

    # ---- the wire

    def _request(self, msg: tuple[Any, ...], what: str,
                 hooks: dict[Any, Any] | None = None) -> Any:
        """Send `msg`, answer the child's calls of `hooks` (the callable arguments, by
        position or keyword), return its reply."""
        hooks = hooks or {}
        failed: BaseException | None = None
        self._send(msg, what)
        while True:
            reply = self._recv(what)
            if reply[0] == "ask":
                _, (_, key), args = reply
                try:
                    answer: tuple[Any, ...] = ("answer", hooks[key](*args))
                except Exception as exc:  # noqa: BLE001 - ends the call; raised below
                    failed, answer = exc, ("abort", f"{type(exc).__name__}: {exc}")
                self._send(answer, what)
                continue
            if failed is not None:
                raise failed
            if reply[0] == "error":
                _, module, qualname, args, message, tb = reply
                exc = rebuild(module, qualname, args, message)
                exc.add_note(f"in engine {self.name}'s process:\n{tb.rstrip()}")
                raise exc
            return reply[1]

    def _send(self, msg: tuple[Any, ...], what: str) -> None:
        try:
            pickle.dump(msg, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, ValueError):
            raise self._died(what) from None

    def _recv(self, what: str) -> tuple[Any, ...]:
        try:
            return pickle.load(self.proc.stdout)  # type: ignore[arg-type]
        except (EOFError, pickle.UnpicklingError, ValueError):
            raise self._died(what) from None

    def _died(self, what: str) -> KVTaxError:
        try:
            rc = self.proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        how = (f"killed by signal {signal.Signals(-rc).name}" if rc < 0
               else f"exited with status {rc}")
        return KVTaxError(f"engine {self.name}'s process (pid {self.proc.pid}) {how} "
                          f"during {what}")

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        hooks: dict[Any, Any] = {}
        args_l = list(args)
        for i, a in enumerate(args_l):
            if callable(a):
                hooks[i], args_l[i] = a, None
        for k, v in kwargs.items():
            if callable(v):
                hooks[k], kwargs[k] = v, None
        where = [("arg", k) if isinstance(k, int) else ("kwarg", k) for k in hooks]
        return self._request(("call", method, args_l, kwargs, where), method, hooks)

    def _end(self) -> None:
        """Let the child exit (killed after EXIT_WAIT_S) and reap it."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    # ---- the Engine methods the probes use

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("facts", {}).get("optional", ()):
            return lambda *args: self._call(name, *args)
        raise AttributeError(f"{type(self).__name__} of engine {self.name} has no {name!r}")

    def child_facts(self) -> dict[str, Any]:
        """The child's pid, whether torch is imported there, the engine's optional methods."""
        return self._request(("facts",), "facts")

    def version(self) -> str:
        return self._call("version")

    def load(self) -> None:
        self._call("load")

    def info(self) -> dict[str, Any]:
        return self._call("info")

    def cache_bytes(self) -> int | None:
        return self._call("cache_bytes")

    def bytes_per_token(self) -> int | None:
        return self._call("bytes_per_token")

    def reset(self) -> None:
        self._call("reset")

    def tokenize(self, text: str) -> list[int]:
        return self._call("tokenize", text)

    def detokenize(self, ids: list[int]) -> str:
        return self._call("detokenize", list(ids))

    def generate(self, ids: list[int], max_new_tokens: int, stop: Any = None) -> list[int]:
        return self._call("generate", list(ids), max_new_tokens, stop=stop)

    def logits(self, ids: list[int], tail: int) -> Any:
        """Float32 numpy [tail, vocab], computed in the child."""
        return self._call("logits", list(ids), tail)

    def logprobs(self, ids: list[int], tail: int) -> Any:
        """Float32 torch [tail, vocab]: the child's logits, log-softmaxed here."""
        return log_softmax(self.logits(ids, tail))

    def close(self) -> None:
        """Free the engine in the child and end the child. A child already dead is only
        reaped: close() runs in `finally` blocks and must not hide the first error."""
        try:
            if self.proc.poll() is None:
                self._call("close")
        except KVTaxError:
            if self.proc.poll() is None:
                raise
        finally:
            self._end()
