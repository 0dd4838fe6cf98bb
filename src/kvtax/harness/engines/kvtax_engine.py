"""kvtax's own runner as an Engine: a DecoderModel over kvtax caches, one attention path.

What `kvtax recall --engine kvtax` and `kvtax quality --engine kvtax` can drive through
the engine interface (and what the generic recall / quality paths are cross-checked
with); `kvtax bench` keeps its own richer cells for kvtax (harness.bench.cells: attention
level, CUDA graphs, mlx-lm's quantized_kv_start, cache growth events), which measure
the same runner.

Arms: kv is any kvtax format (fp16, int8, int4, k8v4, int4-g32...), path one of the
attention paths fused, fp16 (an unquantized cache read by torch SDPA), unfused
(mlx-lm's way), dequant (transformers QuantizedCache's way); hf-quantized is
transformers' own model, not this runner.

    >>> eng = KVTaxEngine(EngineSpec(model="tiny", kv="int8", path="fused"))
    >>> eng.load(); eng.prefill(eng.prompt_ids(256, 0)); eng.decode(8)
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ClassVar

import torch

from kvtax.errors import KVTaxError
from kvtax.harness.engines.base import Engine, MemoryCounter
from kvtax.harness.engines.counters import CudaCounter, RssCounter

PATHS = ("fused", "fp16", "unfused", "dequant")
BASELINE_PATH_ONLY = ("unfused", "dequant")  # ways of reading a *quantized* cache


class KVTaxEngine(Engine):
    """kvtax's Runner behind the engine interface (spec.kv: format, spec.path: path)."""

    name: ClassVar[str] = "kvtax"

    @classmethod
    def arms(cls, kvs: list[str], paths: list[str]) -> list[tuple[str, str]]:
        from kvtax.formats import KVSpec

        out: list[tuple[str, str]] = []
        for path in paths:
            if path not in PATHS:
                raise KVTaxError(f"engine kvtax: unknown path {path!r}; choose from "
                                 f"{', '.join(PATHS)}")
            if path == "fp16":
                out.append(("fp16", "fp16"))
                continue
            for kv in kvs:
                spec = KVSpec.parse(kv)  # FormatError names the valid formats
                if path in BASELINE_PATH_ONLY and not spec.is_quantized:
                    continue
                out.append((kv, path))
        return list(dict.fromkeys(out))

    @classmethod
    def default_kvs(cls) -> list[str]:
        return ["fp16", "int8", "int4"]

    @classmethod
    def default_paths(cls) -> list[str]:
        return ["fused"]

    @classmethod
    def baseline_arm(cls, arms: list[tuple[str, str]]) -> tuple[str, str] | None:
        for cand in (("fp16", "fused"), ("fp16", "fp16"), ("bf16", "fused")):
            if cand in arms:
                return cand
        return arms[0] if arms else None

    def version(self) -> str:
        from kvtax import __version__

        return f"kvtax {__version__}"

    def load(self) -> None:
        from kvtax.attention.baselines import attention_for
        from kvtax.harness.bench.hooks import use_attention
        from kvtax.harness.recall.models import load_recall_model
        from kvtax.models import Runner

        s = self.spec
        if s.path not in PATHS:
            raise KVTaxError(f"engine kvtax: unknown path {s.path!r}")
        self.rm = load_recall_model(s.model, engine="kvtax", dtype=s.dtype, device=s.device,
                                    chunk_size=s.chunk_size, seed=s.seed)
        self.net = self.rm.model
        kv = "fp16" if s.path == "fp16" else s.kv
        self.runner = Runner(self.net, kv=kv, chunk_size=s.chunk_size, cuda_graph=False)
        self.device = self.net.embed.weight.device
        self.stack = contextlib.ExitStack()  # the attention swap, undone by close()
        self.stack.enter_context(use_attention(self.net, attention_for(s.path)))
        self.counter: MemoryCounter = (CudaCounter(str(self.device))
                                       if self.device.type == "cuda" else RssCounter())
        self.caches: list[Any] | None = None
        self.tok: torch.Tensor | None = None

    def memory_counter(self) -> MemoryCounter:
        return self.counter

    def prompt_ids(self, n: int, seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.net.config.vocab_size, (n,), generator=gen).tolist()

    def _fresh(self, tokens: int) -> list[Any]:
        cap = self.spec.capacity if self.spec.options.get("presize") else None
        self.caches = self.runner.make_caches(capacity=max(cap, tokens) if cap else None)
        return self.caches

    def prefill(self, ids: list[int]) -> None:
        caches = self._fresh(len(ids))
        logits = self.runner.prefill(torch.tensor([ids], device=self.device), caches)
        self.tok = logits.argmax(-1, keepdim=True)
        self._sync()

    @torch.no_grad()
    def decode(self, n: int) -> list[float]:
        assert self.caches is not None and self.tok is not None, "decode() before prefill()"
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.tok = self.runner.decode_greedy(self.tok, self.caches)
            self._sync()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def cache_bytes(self) -> int | None:
        return sum(c.nbytes for c in self.caches) if self.caches else None

    def bytes_per_token(self) -> int | None:
        from kvtax.formats import KVSpec
        from kvtax.harness.bench.cells import model_bytes_per_token

        return model_bytes_per_token(self.net.config, KVSpec.parse(self.runner.spec.name),
                                     self.net.embed.weight.dtype)

    def info(self) -> dict[str, Any]:
        return {"attention": self.spec.path, "kv": self.runner.spec.name,
                "device": str(self.device)}

    def reset(self) -> None:
        self.caches, self.tok = None, None

    @torch.no_grad()
    def logprobs(self, ids: list[int], tail: int) -> torch.Tensor:
        """Teacher-forced, chunked like the runner's prefill; `[tail, vocab]` float32."""
        c = len(ids) - 1
        caches = self._fresh(c)
        x = torch.tensor([ids[:c]], device=self.device)
        kept, step = [], self.runner.chunk_size
        for s in range(0, c, step):
            e = min(s + step, c)
            pos = torch.arange(s, e, device=self.device)
            logits = self.net(x[:, s:e], caches, pos, last_only=False)[0]
            lo = max(0, c - tail - s)  # position p predicts ids[p + 1]: the last `tail`
            if lo < e - s:
                kept.append(torch.log_softmax(logits[lo:].float(), -1))
        self.reset()
        return torch.cat(kept)

    @torch.no_grad()
    def generate(self, ids: list[int], max_new_tokens: int, stop: Any = None) -> list[int]:
        caches = self._fresh(len(ids) + max_new_tokens)
        logits = self.runner.prefill(torch.tensor([ids], device=self.device), caches)
        out = self.rm.greedy(self.runner, caches, logits, max_new_tokens, stop=stop)
        self.reset()
        return out

    def tokenize(self, text: str) -> list[int]:
        return list(self.rm.tokenizer.encode(text))

    def detokenize(self, ids: list[int]) -> str:
        return self.rm.tokenizer.decode(ids)

    def prefix_ids(self) -> list[int]:
        """Tokens the tokenizer puts before any text (BOS), for prompts built from text."""
        return list(getattr(self.rm.tokenizer, "prefix_ids", lambda: [])())

    def render_chat(self, user_text: str) -> str | None:
        """The chat template around one user message (None: the model has none)."""
        render = getattr(self.rm.tokenizer, "render_chat", None)
        return render(user_text) if render else None

    def close(self) -> None:
        stack = getattr(self, "stack", None)
        if stack is not None:
            stack.close()
        self.caches = None


ENGINE = KVTaxEngine
