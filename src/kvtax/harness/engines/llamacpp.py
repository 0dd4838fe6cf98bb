"""llama.cpp through llama-cpp-python, in process, on the GGUF the user gives.

Arms are llama-bench's knobs: kv `q8_0` sets K and V to q8_0 (`-ctk q8_0 -ctv q8_0`),
`q8_0:q4_0` sets them apart; path `fa` / `nofa` turns flash attention on / off
(`-fa 1` / `-fa 0`), `auto` leaves it to llama.cpp. `spec.chunk_size` is n_batch (and
n_ubatch), `spec.threads` n_threads.

What really ran is read back, not assumed: llama.cpp's log lines (through
`llama_log_set`) say how flash attention was settled and how big a KV cache it
allocated. A quantized V cache needs flash attention: `nofa` with one is refused by
llama.cpp, and this engine raises EngineUnavailable saying so (a row, never a silent
swap); `auto` may turn flash attention off, which info() reports as
`arm_as_requested: False` with the reason.

The low-level API (llama_cpp._internals) is used rather than `llama_cpp.Llama`, whose
`flash_attn` is a bool and so cannot ask for llama.cpp's auto setting.

    >>> eng = LlamaCppEngine(EngineSpec(model="SmolLM2.gguf", kv="q8_0", path="fa",
    ...                                 threads=2, chunk_size=256, capacity=544))
    >>> eng.load(); eng.prefill(eng.prompt_ids(512, 0)); ms = eng.decode(32)
"""

from __future__ import annotations

import ctypes
import os
import random
import time
from typing import Any

from kvtax.errors import KVTaxError
from kvtax.harness.engines import llamacpp_kv as kvt
from kvtax.harness.engines.base import Engine, EngineSpec, EngineUnavailable
from kvtax.harness.engines.counters import RssCounter

DEFAULT_CTX = 4096  # n_ctx when the cell gives no capacity


class LlamaCppEngine(Engine):
    """llama.cpp's CPU (or whatever the wheel was built for) backend on one GGUF."""

    name = "llama.cpp"
    modules = ("llama_cpp",)
    install = "pip install 'kvtax[llamacpp]'"
    isolated = True  # CUDA builds crash loading a model beside torch (kvtax/__init__.py)

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.type_k, self.type_v = kvt.parse_kv(spec.kv)
        kvt.check_path(spec.path)
        self.log = kvt.LogWatch()
        self._model = self._ctx = self._batch = self._cb = None
        self._counter: RssCounter | None = None
        self._n_past = 0
        self._next: int | None = None
        self._pool: list[int] | None = None
        self.n_batch: int | None = None  # set by load(); info() also runs after a failed one
        self.threads: int | None = None

    # ---- planning (parent process)

    @classmethod
    def arms(cls, kvs: list[str], paths: list[str]) -> list[tuple[str, str]]:
        """Every kv x path; names checked here, so a typo fails before any cell runs.
        Pairs llama.cpp will refuse (quantized V, `nofa`) stay in: their rows say why."""
        for kv in kvs:
            kvt.parse_kv(kv)
        for path in paths:
            kvt.check_path(path)
        return [(kv, path) for kv in kvs for path in paths]

    @classmethod
    def default_kvs(cls) -> list[str]:
        return ["f16", "q8_0", "q4_0"]

    @classmethod
    def default_paths(cls) -> list[str]:
        return ["fa"]

    @classmethod
    def baseline_arm(cls, arms: list[tuple[str, str]]) -> tuple[str, str] | None:
        """The first f16 (K and V) arm, else the first arm."""
        for kv, path in arms:
            if kvt.parse_kv(kv) == ("f16", "f16"):
                return kv, path
        return arms[0] if arms else None

    # ---- worker

    def version(self) -> str:
        import llama_cpp

        return f"llama-cpp-python {llama_cpp.__version__}"

    def load(self) -> None:
        """Load the GGUF and create a context with the arm's cache types and FA setting."""
        import llama_cpp
        from llama_cpp import _internals

        if not os.path.isfile(self.spec.model):
            raise KVTaxError(f"llama.cpp needs a .gguf file as --model; {self.spec.model!r} "
                             f"is not a file")
        self._check_arm()
        self._install_log(llama_cpp)
        mparams = llama_cpp.llama_model_default_params()
        # All layers on the GPU when one is asked for (a CUDA/Metal build), none on CPU.
        mparams.n_gpu_layers = 0 if self.spec.device == "cpu" else 0x7FFFFFFF
        self._model = _internals.LlamaModel(path_model=self.spec.model, params=mparams,
                                            verbose=False)
        self.n_vocab = self._model.n_vocab()
        cparams = self._cparams(llama_cpp)
        try:
            self._ctx = _internals.LlamaContext(model=self._model, params=cparams,
                                                verbose=False)
        except ValueError as e:
            raise EngineUnavailable(f"llama.cpp refused arm {self.spec.kv}/{self.spec.path}: "
                                    f"{self.log.errors() or e}") from None
        self._batch = _internals.LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1,
                                            verbose=False)

    def _cparams(self, llama_cpp: Any) -> Any:
        p = llama_cpp.llama_context_default_params()
        self.n_ctx = int(self.spec.capacity or DEFAULT_CTX)
        self.n_batch = max(1, min(int(self.spec.chunk_size), self.n_ctx))
        threads = int(self.spec.threads or os.cpu_count() or 1)
        p.n_ctx, p.n_batch, p.n_ubatch = self.n_ctx, self.n_batch, self.n_batch
        p.n_threads = p.n_threads_batch = threads
        p.flash_attn_type = kvt.PATHS[self.spec.path]
        p.type_k = kvt.CACHE_TYPES[self.type_k][0]
        p.type_v = kvt.CACHE_TYPES[self.type_v][0]
        p.no_perf = True
        self.threads = threads
        return p

    def _check_arm(self) -> None:
        # llama.cpp would refuse too, with only a generic "Failed to create llama_context".
        if self.spec.path == "nofa" and kvt.needs_fa(self.spec.kv):
            raise EngineUnavailable(
                f"llama.cpp cannot run kv {self.spec.kv} without flash attention (a quantized "
                f"V cache requires it): arm {self.spec.kv}/nofa not run; use path fa")

    def _install_log(self, llama_cpp: Any) -> None:
        """Route llama.cpp's log into self.log (undone in close())."""
        watch = self.log

        @llama_cpp.llama_log_callback
        def callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            watch.add(int(level), text.decode("utf-8", "replace"))

        self._cb = callback  # ctypes drops the C pointer if the Python object dies
        llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))

    def memory_counter(self) -> RssCounter:
        """This process's RSS: ggml allocates its buffers outside torch."""
        if self._counter is None:
            self._counter = RssCounter()
        return self._counter

    def prompt_ids(self, n: int, seed: int) -> list[int]:
        """BOS (when the model adds one) + seeded random ordinary tokens, `n` in all."""
        import llama_cpp

        if self._pool is None:
            normal = llama_cpp.LLAMA_TOKEN_ATTR_NORMAL
            self._pool = [t for t in range(self.n_vocab)
                          if llama_cpp.llama_vocab_get_attr(self._model.vocab, t) & normal]
        rng = random.Random(seed)
        return (self.prefix_ids() + [rng.choice(self._pool) for _ in range(n)])[:n]

    # ---- running

    def _eval(self, ids: list[int], want: set[int] | None = None) -> dict[int, Any]:
        """Append `ids` at the current position in n_batch chunks; the logits of the
        positions in `want` (offsets into `ids`), plus the last one, as numpy rows."""
        import numpy as np

        if self._ctx is None:
            raise KVTaxError("llama.cpp engine: load() first")
        if self._n_past + len(ids) > self._ctx.n_ctx():
            raise KVTaxError(f"llama.cpp context of {self._ctx.n_ctx()} tokens cannot hold "
                             f"{self._n_past} + {len(ids)}; give a larger capacity")
        want = set(want or ()) | {len(ids) - 1}
        out: dict[int, Any] = {}
        b = self._batch.batch
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start:start + self.n_batch]
            b.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                b.token[i], b.pos[i] = tok, self._n_past + i
                b.seq_id[i][0], b.n_seq_id[i] = 0, 1
                b.logits[i] = (start + i) in want
            self._ctx.decode(self._batch)
            self._n_past += len(chunk)
            for i in range(len(chunk)):
                if (start + i) in want:
                    row = self._ctx.get_logits_ith(i)
                    out[start + i] = np.ctypeslib.as_array(row, shape=(self.n_vocab,)).copy()
        return out

    def _argmax_last(self, logits: dict[int, Any]) -> int:
        return int(logits[max(logits)].argmax())

    def reset(self) -> None:
        """An empty KV cache (the allocation stays)."""
        if self._ctx is not None:
            self._ctx.kv_cache_clear()
        self._n_past, self._next = 0, None

    def prefill(self, ids: list[int]) -> None:
        """The prompt into a fresh cache, then the first greedy token (TTFT ends here)."""
        self.reset()
        self._next = self._argmax_last(self._eval(list(ids)))

    def decode(self, n: int) -> list[float]:
        """`n` greedy steps, one token each, EOS ignored; wall ms per step."""
        if self._next is None:
            raise KVTaxError("llama.cpp engine: decode() before prefill()")
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            self._next = self._argmax_last(self._eval([self._next]))
            samples.append((time.perf_counter() - t0) * 1e3)
        return samples

    def logits(self, ids: list[int], tail: int) -> Any:
        """Teacher-forced logits [tail, vocab] (float32 numpy): row i predicts
        ids[len(ids) - tail + i], from the position before it (`logprobs` is their
        log-softmax)."""
        import numpy as np

        if not 0 < tail < len(ids):
            raise KVTaxError(f"logprobs: tail {tail} must be in 1..{len(ids) - 1}")
        self.reset()
        first = len(ids) - tail - 1
        rows = self._eval(list(ids[:-1]), want=set(range(first, len(ids) - 1)))
        return np.stack([rows[i] for i in range(first, len(ids) - 1)])

    def generate(self, ids: list[int], max_new_tokens: int, stop: Any = None) -> list[int]:
        """Greedy tokens after `ids` in a fresh cache, up to an end-of-generation token,
        `max_new_tokens`, or `stop(text_so_far)` true."""
        import llama_cpp

        self.prefill(ids)
        new: list[int] = []
        while len(new) < max_new_tokens:
            tok = int(self._next)  # type: ignore[arg-type]
            if llama_cpp.llama_vocab_is_eog(self._model.vocab, tok):
                break
            new.append(tok)
            if stop is not None and stop(self.detokenize(new)):
                break
            if len(new) < max_new_tokens:
                self._next = self._argmax_last(self._eval([tok]))
        return new

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, no BOS (prefix_ids() gives it); special tokens such as a
        chat template's `<|im_start|>` are parsed as such."""
        return self._model.tokenize(text.encode("utf-8"), False, True)

    def prefix_ids(self) -> list[int]:
        """What the model puts before any text: its BOS, if it adds one."""
        return [self._model.token_bos()] if self._model.add_bos_token() else []

    def detokenize(self, ids: list[int]) -> str:
        return self._model.detokenize(list(ids)).decode("utf-8", "replace")

    def render_chat(self, user_text: str) -> str | None:
        """One user message in the GGUF's chat template (llama.cpp's built-in renderer
        of it), ready for the assistant's answer; None if the GGUF has no template."""
        import llama_cpp

        tmpl = llama_cpp.llama_model_chat_template(self._model.model, None)
        if not tmpl:
            return None
        msg = (llama_cpp.llama_chat_message * 1)()
        msg[0].role, msg[0].content = b"user", user_text.encode("utf-8")
        size = 4 * len(user_text) + 1024
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(tmpl, msg, 1, True, buf, size)
            if n < 0:
                return None  # a template llama.cpp cannot render
            if n <= size:
                return buf.raw[:n].decode("utf-8", "replace")
            size = n + 1
        return None

    # ---- what it cost, what ran

    def _shape(self) -> tuple[int, int, int, int]:
        """(layers, KV heads, K head dim, V head dim) from the GGUF's metadata."""
        import llama_cpp

        meta = self._model.metadata()
        arch = meta.get("general.architecture", "llama")
        n_layer = llama_cpp.llama_model_n_layer(self._model.model)
        n_head = llama_cpp.llama_model_n_head(self._model.model)
        n_head_kv = llama_cpp.llama_model_n_head_kv(self._model.model)
        d = llama_cpp.llama_model_n_embd(self._model.model) // n_head
        head_k = int(meta.get(f"{arch}.attention.key_length", d))
        head_v = int(meta.get(f"{arch}.attention.value_length", d))
        return n_layer, n_head_kv, head_k, head_v

    def bytes_per_token(self) -> int | None:
        """KV bytes per token over all layers, from the cache types and GGUF shape."""
        return kvt.bytes_per_token(self.spec.kv, *self._shape())

    def cache_bytes(self) -> int | None:
        """The KV cache llama.cpp allocated (n_ctx cells), from its own log line."""
        kv = self.log.kv_cache()
        return kv["bytes"] if kv else None

    def info(self) -> dict[str, Any]:
        """Which attention path ran, the cache llama.cpp built, and the build."""
        import llama_cpp

        fa = self.log.flash_attn()
        ran = None if fa is None else ("fa" if fa else "nofa")
        as_requested = ran is not None and (self.spec.path == "auto" or ran == self.spec.path)
        kv = self.log.kv_cache()
        out: dict[str, Any] = {
            "flash_attn_requested": self.spec.path,
            "flash_attn": fa,
            "path_ran": ran,
            "arm_as_requested": as_requested,
            "cache_type_k": self.type_k,
            "cache_type_v": self.type_v,
            "n_ctx": self._ctx.n_ctx() if self._ctx is not None else None,
            "n_batch": self.n_batch,
            "n_threads": self.threads,
            "kv_cache_log": kv,
            # llama.cpp's own count of the state it would save now: the cells in use
            # (not the whole allocation) plus logits and a small header.
            "state_bytes": self._ctx.get_state_size() if self._ctx is not None else None,
            "n_past": self._n_past,
            "model_desc": self._model.desc() if self._model is not None else None,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "llama_warnings": self.log.warnings[-5:],
            # llama.cpp rotates Q/K/V (Hadamard) before a quantized cache unless this is 1.
            "attn_rot_disable": os.environ.get("LLAMA_ATTN_ROT_DISABLE"),
        }
        if kv and (kv["type_k"], kv["type_v"]) != (self.type_k, self.type_v):
            out["arm_as_requested"] = False
        if not out["arm_as_requested"]:
            out["arm_note"] = (f"asked path {self.spec.path} kv {self.type_k}:{self.type_v}; "
                               f"llama.cpp ran {ran or 'unknown'} with "
                               f"{kv['type_k'] + ':' + kv['type_v'] if kv else 'unknown types'}")
        return out

    def close(self) -> None:
        """Free the context, batch and model; give llama.cpp's log back to llama_cpp."""
        for obj in (self._batch, self._ctx, self._model):
            if obj is not None:
                obj.close()
        self._batch = self._ctx = self._model = None
        if self._cb is not None:
            import llama_cpp
            from llama_cpp import _logger

            llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
            self._cb = None


ENGINE = LlamaCppEngine
