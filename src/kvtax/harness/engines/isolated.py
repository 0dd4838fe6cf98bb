"""The child side of an isolated engine: `python -m kvtax.harness.engines.isolated PARENT_PID`.

It serves one engine's method calls from its parent (engines.process.EngineProcess) and
never imports torch: a CUDA build of llama-cpp-python 0.3.36 segfaulted in model load in
any process that had imported torch 2.11 (H200, 2026-12-03), even with no CUDA use.

The wire is a stream of pickled tuples: requests on stdin, replies on a copy of fd 1
(fd 1 itself then points at stderr, so what the engine's C code prints cannot corrupt it).

    parent -> child                            child -> parent
    ("start", module, class name, EngineSpec)  ("ok", facts())
    ("facts",)                                 ("ok", facts())
    ("call", method, args, kwargs, hooks)      ("ok", value) | ("error", ...)
                                               ("ask", hook, args): a callback argument
    ("answer", value) | ("abort", message)       called; the parent answers it

`hooks` name the callable arguments, sent as None: ("arg", i) or ("kwarg", name). The child
calls them back through the parent (e.g. `generate`'s `stop(text)`). An exception
becomes ("error", module, class name, args, message, traceback), raised again as the same
type in the parent.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from typing import Any, BinaryIO

from kvtax.errors import KVTaxError
from kvtax.harness.lifeline import die_with_parent

# Optional Engine methods the parent's proxy offers only when the engine has them.
OPTIONAL = ("prefix_ids", "render_chat")


def facts(engine: Any = None) -> dict[str, Any]:
    """What the parent may check about this process: its pid, whether torch was imported
    here (it never must be), and which optional methods the engine has."""
    return {"pid": os.getpid(), "torch_imported": "torch" in sys.modules,
            "optional": [m for m in OPTIONAL if engine is not None and hasattr(engine, m)]}


def error_message(exc: BaseException) -> tuple[Any, ...]:
    """An exception as an ("error", ...) message (its args only when they pickle)."""
    try:
        args = pickle.loads(pickle.dumps(exc.args))
    except Exception:  # noqa: BLE001 - unpicklable args: the message is enough
        args = (str(exc),)
    return ("error", type(exc).__module__, type(exc).__qualname__, args, str(exc),
            traceback.format_exc())


class Server:
    """One engine behind a pair of binary pipes."""

    def __init__(self, inp: BinaryIO, out: BinaryIO) -> None:
        self.inp, self.out, self.engine = inp, out, None

    def send(self, msg: tuple[Any, ...]) -> None:
        pickle.dump(msg, self.out, protocol=pickle.HIGHEST_PROTOCOL)
        self.out.flush()

    def serve(self) -> None:
        """Answer requests until the parent closes the pipe or says "exit"."""
        while True:
            try:
                msg = pickle.load(self.inp)
            except EOFError:
                return
            if msg[0] == "exit":
                return
            try:
                self.send(("ok", self.handle(msg)))
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the parent
                self.send(error_message(exc))

    def handle(self, msg: tuple[Any, ...]) -> Any:
        tag = msg[0]
        if tag == "start":
            _, module, name, spec = msg
            cls = getattr(importlib.import_module(module), name)
            self.engine = cls(spec)
            return facts(self.engine)
        if tag == "facts":
            return facts(self.engine)
        if tag == "call":
            _, method, args, kwargs, hooks = msg
            if self.engine is None:
                raise KVTaxError("isolated engine: no engine started")
            args = list(args)
            for where, key in hooks:
                if where == "arg":
                    args[key] = self.hook((where, key))
                else:
                    kwargs[key] = self.hook((where, key))
            return getattr(self.engine, method)(*args, **kwargs)
        raise KVTaxError(f"isolated engine: unknown request {tag!r}")

    def hook(self, key: tuple[str, Any]) -> Any:
        """A stand-in for the parent's callable argument `key`: each call asks the parent."""

        def call(*args: Any) -> Any:
            self.send(("ask", key, args))
            tag, value = pickle.load(self.inp)
            if tag == "abort":
                raise KVTaxError(value)
            return value

        return call


def main() -> None:
    die_with_parent(int(sys.argv[1]))  # argv[1]: the parent's pid
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # print() and C stdout now land on stderr, away from the replies
    Server(sys.stdin.buffer, out).serve()


if __name__ == "__main__":
    main()
