"""The `mlx-lm` engine: mlx-lm's own model code and KV caches, driven in process.

Arms (kv × path):
- kv `fp16`: mlx-lm's `KVCache` in the model's dtype (unquantized; float32 for the
  built-in random configs unless `--dtype` says otherwise). `q8`, `q4`, `q4-g32`, ...:
  `QuantizedKVCache(bits, group_size)` (`q<bits>[-g<group>]`, group 64 by default), from
  the first token on (mlx-lm's `generate` waits for `quantized_kv_start`, 5000 tokens by
  default; here every context measures the format it names).
- path `default`: the cache grows the way mlx-lm grows it (`step` = 256 tokens, a
  concatenate-and-copy per resize). `presized`: the cache's `step` covers prompt + decode
  (`spec.capacity`), so one allocation holds everything and no resize happens: the first
  of the two discriminators of the published mlx-lm measurements. The second, the prefill
  chunk, is `prefill_step_size` = `spec.chunk_size` (`--chunk-size`).

Prefill runs the way `mlx_lm.generate_step` does: the prompt but its last token in
`prefill_step_size` chunks (each evaluated, then `mx.clear_cache()`), then the last token,
whose logits give the first token (TTFT). Decode: greedy steps, one `mx.eval` per token
(mlx is lazy: a step is timed only once its token is computed).

Which attention ran: every call of `mx.fast.scaled_dot_product_attention` (what mlx-lm
calls for an unquantized cache) and of mlx-lm's `quantized_scaled_dot_product_attention`
(its quantized-cache fallback: `quantized_matmul` → softmax → `quantized_matmul`, the
full `[heads, queries, context]` score matrix materialized) is counted. Only Metal has a
fused SDPA kernel: on `mlx[cpu]` the fast op itself falls back to unfused ops (measured
2026-12-01, mlx 0.32.4 on the Linux CPU this was written on: 8 heads × 1024 queries ×
1024 keys allocated 37 MiB above its inputs, the 32 MiB score matrix included), so both
paths are unfused there and the inversion measured on Macs cannot appear; `info()` says so.

Models: an MLX model folder or hub id (`mlx_lm.load`, with its tokenizer), a `.gguf` file
(converted once to a safetensors folder, as `kvtax recall` does, then `mlx_lm.load`), or a
kvtax built-in config name (llama / mistral / qwen2 / qwen3 shapes; random weights built
in process from mlx-lm's model classes, kvtax's byte tokenizer, as kvtax's runner gives
its built-ins). Memory: `mx.get_peak_memory()` reset per phase (`mx.reset_peak_memory()`).
Device: `--device cpu` runs on mlx's CPU; `--device mps` on a Mac's GPU (Metal).
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvtax.errors import KVTaxError
from kvtax.harness.engines.base import Engine, EngineSpec, EngineUnavailable
from kvtax.harness.engines.text import TextEngine, eos_ids
from kvtax.harness.text import text_tokenizer

_KV = re.compile(r"^q(\d)(?:-g(\d+))?$")
BITS = (2, 3, 4, 5, 6, 8)      # what mx.quantize accepts
GROUPS = (32, 64, 128)
PATHS = ("default", "presized")
_BUILTIN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16",
           "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def parse_kv(kv: str) -> tuple[int, int] | None:
    """`fp16` → None (unquantized KVCache); `q<bits>[-g<group>]` → (bits, group_size).
    Raises KVTaxError (one line) for any other name."""
    if kv == "fp16":
        return None
    m = _KV.match(kv)
    if m is None:
        raise KVTaxError(f"mlx-lm has no kv {kv!r}; use fp16 or q<bits>[-g<group>] "
                         f"(bits {BITS}, group {GROUPS}), e.g. q8, q4, q4-g32")
    bits, group = int(m.group(1)), int(m.group(2) or 64)
    if bits not in BITS or group not in GROUPS:
        raise KVTaxError(f"mlx-lm kv {kv!r}: bits must be one of {BITS} and group one of "
                         f"{GROUPS}")
    return bits, group


def mlx_device(device: str) -> str:
    """mlx's device for a `--device` value: "cpu", else "gpu" (Metal on a Mac: `--device
    mps`; mlx's CUDA backend: `--device cuda`)."""
    if device == "cpu":
        return "cpu"
    if device in ("mps", "metal", "gpu") or device.startswith("cuda"):
        return "gpu"
    raise KVTaxError(f"mlx-lm: unknown device {device!r}; use cpu, mps (Metal) or cuda")


class MlxCounter:
    """mlx's own allocator counters: active bytes now, peak since `reset` (bytes)."""

    kind = "mlx_peak"

    def __init__(self, mx: Any) -> None:
        self.mx = mx

    def reset(self) -> None:
        self.mx.synchronize()
        self.mx.reset_peak_memory()

    def current(self) -> int | None:
        return int(self.mx.get_active_memory())

    def peak(self) -> int | None:
        self.mx.synchronize()
        return int(self.mx.get_peak_memory())


@contextlib.contextmanager
def counting_sdpa(counts: dict[str, int]) -> Iterator[None]:
    """Count calls of mlx's fast SDPA and of mlx-lm's quantized fallback while inside;
    the originals are put back on exit (models look both up at call time)."""
    import mlx.core as mx
    from mlx_lm.models import base

    fast, quant = mx.fast.scaled_dot_product_attention, base.quantized_scaled_dot_product_attention

    def counted(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[key] = counts.get(key, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    mx.fast.scaled_dot_product_attention = counted("fast", fast)
    base.quantized_scaled_dot_product_attention = counted("quantized", quant)
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = fast
        base.quantized_scaled_dot_product_attention = quant


def builtin_model(name: str, dtype: str, seed: int) -> tuple[Any, Any, set[int]]:
    """(mlx-lm Model with random weights, byte tokenizer, EOS ids) for a kvtax built-in
    config; raises KeyError when `name` is not one, EngineUnavailable for an unmapped
    family."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    from kvtax.harness.bench.hf_quantized import hf_config
    from kvtax.models import get_config

    cfg = get_config(name)
    if cfg.family not in _BUILTIN_FAMILIES or cfg.sliding_window is not None:
        raise EngineUnavailable(f"mlx-lm: built-in {name} ({cfg.family}) is not mapped to an "
                                "mlx-lm model here; give an MLX model folder or a .gguf")
    conf = hf_config(cfg).to_dict()
    # transformers 5 nests RoPE in rope_parameters; mlx-lm's ModelArgs read the flat keys.
    conf.update(rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling)
    model_cls, args_cls = _get_classes(conf)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(conf))
    model.set_dtype(getattr(mx, _DTYPES[dtype]))
    mx.eval(model.parameters())
    eos = eos_ids(cfg.eos_token_id)
    return model, text_tokenizer(bos=cfg.bos_token_id, eos=min(eos, default=None)), eos


def flat_rope(folder: str) -> dict[str, Any]:
    """The flat `rope_theta` / `rope_scaling` mlx-lm's ModelArgs read, for a folder whose
    config.json nests RoPE in transformers 5's `rope_parameters` (as kvtax's GGUF
    conversion writes it): without them mlx-lm silently uses theta 10000."""
    import json

    conf = Path(folder) / "config.json"
    if not conf.is_file():
        return {}  # a hub id: mlx-lm reads the downloaded config itself
    cfg = json.loads(conf.read_text())
    rope = cfg.get("rope_parameters")
    if cfg.get("rope_theta") is not None or not isinstance(rope, dict) \
            or "rope_theta" not in rope:
        return {}
    out: dict[str, Any] = {"rope_theta": rope["rope_theta"]}
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


class MlxLmEngine(TextEngine, Engine):
    """mlx-lm in process (see the module docstring for arms, phases and counters)."""

    name = "mlx-lm"
    modules = ("mlx", "mlx_lm")
    install = "pip install 'kvtax[mlx]'  (mlx-lm with mlx; mlx[cpu] on Linux)"

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.quant = parse_kv(spec.kv)
        if spec.path not in PATHS:
            raise KVTaxError(f"mlx-lm has no path {spec.path!r}; use {', '.join(PATHS)}")
        self.model: Any = None
        self.cache: list[Any] = []
        self.sdpa: dict[str, int] = {}
        self.resizes = {"prefill": 0, "decode": 0}
        self.source = ""
        self._stack = contextlib.ExitStack()
        self._tok: Any = None

    # ---- the sweep's view

    @classmethod
    def arms(cls, kvs: list[str], paths: list[str]) -> list[tuple[str, str]]:
        return cls.checked_product("mlx-lm", kvs, paths, parse_kv, PATHS)

    @classmethod
    def default_kvs(cls) -> list[str]:
        return ["fp16", "q8", "q4"]

    @classmethod
    def baseline_arm(cls, arms: list[tuple[str, str]]) -> tuple[str, str] | None:
        return next((a for a in arms if a[0] == "fp16"), arms[0] if arms else None)

    # ---- inside the worker

    def version(self) -> str:
        from importlib.metadata import version

        return f"mlx-lm {version('mlx-lm')}, mlx {version('mlx')}"

    def load(self) -> None:
        import mlx.core as mx

        dev = mlx_device(self.spec.device)
        if not mx.is_available(getattr(mx, dev)):
            raise EngineUnavailable(f"mlx-lm: device {self.spec.device!r} ({dev}) is not "
                                    "available in this mlx build")
        mx.set_default_device(getattr(mx, dev))
        self._stack.enter_context(counting_sdpa(self.sdpa))
        self.model, self.text, self.eos, self.source = self._load_model()
        self.reset()

    def _load_model(self) -> tuple[Any, Any, set[int], str]:
        """(model, text tokenizer, EOS ids, where it came from)."""
        src, dtype = self.spec.model, _DTYPES.get(self.spec.dtype.lower())
        if dtype is None:
            raise KVTaxError(f"mlx-lm: unknown dtype {self.spec.dtype!r}")
        try:
            return (*builtin_model(src, dtype, self.spec.seed),
                    f"built-in {src} (random weights, {dtype})")
        except KeyError:
            pass
        from mlx_lm import load

        path, how = Path(src).expanduser(), f"{src} (mlx_lm.load)"
        if path.suffix == ".gguf":
            from kvtax.harness.recall.models import gguf_folder

            src, how = str(gguf_folder(path)), f"{path.name} (GGUF → safetensors, mlx_lm.load)"
        model, wrapper = load(src, model_config=flat_rope(src))
        hf = getattr(wrapper, "_tokenizer", wrapper)
        return (model, text_tokenizer(hf), eos_ids(sorted(wrapper.eos_token_ids),
                                                   hf.eos_token_id), how)

    def _new_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

        cache = make_prompt_cache(self.model)
        if self.quant is not None:
            others = {type(c).__name__ for c in cache if type(c) is not KVCache}
            if others:
                raise EngineUnavailable(f"mlx-lm cannot quantize {', '.join(sorted(others))} "
                                        f"(this model's layers): kv {self.spec.kv} impossible")
            bits, group = self.quant
            cache = [QuantizedKVCache(group_size=group, bits=bits) for _ in cache]
        if self.spec.path == "presized":
            if not self.spec.capacity:
                raise EngineUnavailable("mlx-lm presized needs the capacity (prompt + decode)")
            step = -(-int(self.spec.capacity) // 256) * 256
            for c in cache:
                if hasattr(c, "step"):
                    c.step = step  # one allocation covers the whole cell: no resize
        return cache

    def _allocated(self) -> int:
        """Token slots allocated by layer 0's cache (grows on a resize)."""
        keys = getattr(self.cache[0], "keys", None)
        if keys is None:
            return 0
        return int((keys[0] if isinstance(keys, tuple | list) else keys).shape[2])

    def _forward(self, ids: Any, phase: str) -> Any:
        """Logits [1, tokens, vocab] (lazy) of `ids` [1, tokens] through the cache; a
        resize (layer 0's slots growing after its first allocation) is counted."""
        before = self._allocated()
        out = self.model(ids, cache=self.cache)
        if before and self._allocated() > before:
            self.resizes[phase] += 1
        return out

    def prompt_ids(self, n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        vocab = self._vocab()
        return [rng.randrange(vocab) for _ in range(n)]

    def _vocab(self) -> int:
        args = getattr(self.model, "args", None)
        vocab = getattr(args, "vocab_size", None)
        if not vocab:
            raise EngineUnavailable("mlx-lm: cannot tell this model's vocabulary size")
        return int(vocab)

    def _prefill_logits(self, ids: list[int], keep: int = 1) -> Any:
        """`ids` through a fresh cache the way mlx_lm.generate_step does; the logits
        [keep, vocab] of the last `keep` positions (unevaluated chunk logits cost nothing:
        mlx computes only what is evaluated)."""
        import mlx.core as mx

        if not ids:
            raise KVTaxError("mlx-lm: an empty prompt")
        self.reset()
        step, prompt, done = max(1, int(self.spec.chunk_size)), mx.array(ids), 0
        kept = None
        while len(ids) - done > 1:
            n = min(step, len(ids) - done - 1)
            out = self._forward(prompt[None, done:done + n], "prefill")[0]
            if keep > 1:
                kept = (out if kept is None else mx.concatenate([kept, out]))[-(keep - 1):]
            mx.eval([c.state for c in self.cache] + ([kept] if kept is not None else []))
            done += n
            mx.clear_cache()
        last = self._forward(prompt[None, done:], "prefill")[0, -1:]
        return last if kept is None else mx.concatenate([kept, last])

    def prefill(self, ids: list[int]) -> None:
        import mlx.core as mx

        self._tok = mx.argmax(self._prefill_logits(ids), axis=-1)
        mx.eval(self._tok)

    def decode(self, n: int) -> list[float]:
        import mlx.core as mx

        if self._tok is None:
            raise KVTaxError("mlx-lm: decode before prefill")
        ms = []
        for _ in range(n):
            t0 = time.perf_counter()
            logits = self._forward(self._tok[None], "decode")[0, -1:]
            self._tok = mx.argmax(logits, axis=-1)
            mx.eval(self._tok)
            ms.append((time.perf_counter() - t0) * 1e3)
        return ms

    def memory_counter(self) -> MlxCounter:
        import mlx.core as mx

        return MlxCounter(mx)

    def cache_bytes(self) -> int | None:
        return sum(c.nbytes for c in self.cache) if self.cache and not self.cache[0].empty() \
            else None

    def bytes_per_token(self) -> int | None:
        """Allocated cache bytes over allocated slots, summed over the layers (exact:
        codes + scales + biases of a QuantizedKVCache, K and V of a KVCache)."""
        slots = self._allocated()
        if not slots:
            return None
        return sum(c.nbytes // slots for c in self.cache)

    def info(self) -> dict[str, Any]:
        import mlx.core as mx

        fast, quant = self.sdpa.get("fast", 0), self.sdpa.get("quantized", 0)
        metal = bool(mx.metal.is_available())
        device = str(mx.default_device())
        fused_kernel = metal and "gpu" in device
        sdpa = ("mlx-lm quantized fallback (quantized_scaled_dot_product_attention)" if quant
                else "mx.fast.scaled_dot_product_attention")
        bits = self.quant
        return {
            "sdpa": sdpa, "sdpa_calls": {"fast": fast, "quantized": quant},
            "sdpa_fused_kernel": fused_kernel and not quant,
            "sdpa_note": None if fused_kernel else (
                f"on {device} mx.fast.scaled_dot_product_attention runs unfused ops (no "
                "Metal): both arms materialize the score matrix, so the fused-vs-fallback "
                "inversion measured on Macs cannot appear here"),
            "mlx_device": device, "metal_available": metal,
            "cache": (f"QuantizedKVCache(bits={bits[0]}, group_size={bits[1]})" if bits
                      else "KVCache"),
            "cache_step": getattr(self.cache[0], "step", None) if self.cache else None,
            "cache_slots": self._allocated() if self.cache else None,
            "prefill_growth_events": self.resizes["prefill"],
            "decode_growth_events": self.resizes["decode"],
            "prefill_step_size": int(self.spec.chunk_size),
            "model_source": self.source,
            "threads": "mlx sets its own CPU threads (spec.threads is not applied)",
        }

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.resizes = {"prefill": 0, "decode": 0}
        self.sdpa.clear()  # counts describe the prompt since the last reset
        self._tok = None

    def logprobs(self, ids: list[int], tail: int) -> Any:
        """Teacher-forced log-probabilities [tail, vocab] (float32 torch): row i predicts
        ids[len(ids) - tail + i], every position read through this arm's cache."""
        import mlx.core as mx
        import numpy as np
        import torch

        if not 0 < tail < len(ids):
            raise KVTaxError(f"mlx-lm logprobs: tail {tail} must be in 1..{len(ids) - 1}")
        logits = self._prefill_logits(ids[:-1], keep=tail).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(logp)
        return torch.from_numpy(np.array(logp, copy=True))

    def last_token(self) -> int:
        return int(self._tok.item())

    def close(self) -> None:
        self._stack.close()
        self.model, self.cache, self._tok = None, [], None


ENGINE = MlxLmEngine
