"""The `transformers` engine: a stock transformers model with each of its KV caches.

Arms (kv × path):
- kv `dynamic` (DynamicCache, grows), `static` (StaticCache preallocated for
  `spec.capacity` tokens), `quanto-int4` / `quanto-int2` and `hqq-int4` / `hqq-int2` /
  `hqq-int8` ... (transformers' QuantizedCache with that backend, `-g<group>` optional,
  group 64, residual 128 fp tokens; the backend package must be installed), `fp8`
  (QuantizedCache's fp8 backend, one scale per tensor), `kvtax-<format>` (kvtax's
  adapter: `kvtax.hf.KVTaxCache(kv=format)` inside `kvtax.hf.installed(model)`; e.g.
  `kvtax-int8`, `kvtax-int4`, `kvtax-k8v4`, `kvtax-q4`; hybrid formats such as q4 eager
  only).
- path `eager`, or `compiled`: the one-token decode forward goes through transformers'
  own `model.get_compiled_call(CompileConfig())` (what `generate` compiles); prefill
  stays eager, as in `generate`. Only a compileable (static-shape) cache can be compiled
  — StaticCache and KVTaxCache(max_cache_len) — so `compiled` with any other kv is an
  unavailable row that says why. `--engine-option compile_mode=...` / `compile_backend=...`
  override CompileConfig's mode and backend.

The engine drives `model(...)` the way `generate` does, so its phases are the harness's:
prefill in `chunk_size` chunks (TTFT: the last chunk's logits give the first token),
then greedy one-token steps, EOS ignored, each timed after a device synchronize. Its
`quanto-int4` arm is the bench's `int4/hf-quantized` arm (harness/bench/hf_quantized.py) with
the same cache settings, so that arm can move here.

Models: a kvtax built-in config name (a stock transformers model of the same shapes with
random weights, `hf_quantized.build_hf_model`; kvtax's byte tokenizer), a HF folder or
hub id, or a `.gguf` file (transformers' `gguf_file` loading, weights dequantized).
Memory: CUDA allocated bytes on CUDA, process RSS on CPU (harness/bench/memory.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvtax.errors import KVTaxError
from kvtax.harness.engines.base import Engine, EngineSpec, EngineUnavailable, MemoryCounter
from kvtax.harness.engines.text import TextEngine, eos_ids
from kvtax.harness.text import text_tokenizer

PATHS = ("eager", "compiled")
_QUANT = re.compile(r"^(quanto|hqq)-int(\d)(?:-g(\d+))?$")
BACKEND_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
BACKEND_INSTALL = {"quanto": "pip install optimum-quanto", "hqq": "pip install hqq"}
COMPILEABLE = ("static", "kvtax")
WARM_STEPS = 3  # untimed compiled decode steps in setup (a specialization, a recompile)


class KvArm(NamedTuple):
    """A parsed kv name: kind (dynamic, static, quanto, hqq, fp8, kvtax), the QuantizedCache
    bits and group (quanto / hqq), the kvtax format (kvtax)."""

    kind: str
    bits: int | None = None
    group: int | None = None
    fmt: str | None = None


def parse_kv(kv: str) -> KvArm:
    """The arm named `kv`; KVTaxError (one line) for a name this engine does not know."""
    if kv in ("dynamic", "static", "fp8"):
        return KvArm(kv)
    m = _QUANT.match(kv)
    if m:
        backend, bits, group = m.group(1), int(m.group(2)), int(m.group(3) or 64)
        if bits not in BACKEND_BITS[backend]:
            raise KVTaxError(f"transformers kv {kv!r}: {backend} quantizes to "
                             f"{BACKEND_BITS[backend]} bits")
        return KvArm(backend, bits, group)
    if kv.startswith("kvtax-"):
        from kvtax.formats.hybrid import parse_kv as parse_format

        parse_format(kv[len("kvtax-"):])  # FormatError names the valid formats
        return KvArm("kvtax", fmt=kv[len("kvtax-"):])
    raise KVTaxError(f"transformers has no kv {kv!r}; use dynamic, static, quanto-int4, "
                     "quanto-int2, hqq-int4, ..., fp8 or kvtax-<format> (e.g. kvtax-int8)")


def arm_unavailable(arm: KvArm, path: str, model: str) -> str | None:
    """Why this arm cannot run here (None when it can), checked before any weights load."""
    if path == "compiled" and arm.kind not in COMPILEABLE:
        return (f"transformers compiles a decode step only over a compileable (static-shape) "
                f"cache; {arm.kind} is not (compiled runs with static or kvtax-*)")
    if arm.kind == "kvtax" and path == "compiled":
        from kvtax.formats.hybrid import HybridSpec, parse_kv as parse_format

        if isinstance(parse_format(arm.fmt), HybridSpec):
            return (f"kvtax-{arm.fmt} keeps fp16 sink / recent tokens beside its body: "
                    "KVTaxCache runs such formats eagerly only (no compiled decode yet)")
    if arm.kind == "quanto":
        from kvtax.harness.bench.hf_quantized import hf_quantized_unavailable

        return hf_quantized_unavailable(f"int{arm.bits}-g{arm.group}", model)
    if arm.kind == "hqq" and importlib.util.find_spec("hqq") is None:
        return f"QuantizedCache(backend='hqq') needs hqq, which is not installed: " \
               f"{BACKEND_INSTALL['hqq']}"
    return None


def load_hf(source: str, dtype: torch.dtype, device: torch.device,
            seed: int) -> tuple[Any, Any, set[int], str]:
    """(model, text tokenizer, EOS ids, where it came from) for a built-in config name,
    a HF folder / hub id, or a `.gguf` file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtax.harness.bench.hf_quantized import build_hf_model
    from kvtax.models import get_config
    from kvtax.models.tokenizer_check import check_tokenizer

    try:
        cfg = get_config(source)
    except KeyError:
        cfg = None
    if cfg is not None:
        model = build_hf_model(source, dtype=dtype, device=device, seed=seed)
        eos = eos_ids(cfg.eos_token_id)
        text = text_tokenizer(bos=cfg.bos_token_id, eos=min(eos, default=None))
        return model, text, eos, f"built-in {source} (random weights)"
    path = Path(source).expanduser()
    where, extra = source, {}
    if path.suffix == ".gguf":
        where, extra = str(path.parent), {"gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **extra).to(device)
    tok = AutoTokenizer.from_pretrained(where, **extra)
    check_tokenizer(tok, source)
    eos = eos_ids(tok.eos_token_id, model.generation_config.eos_token_id)
    return model.eval().requires_grad_(False), text_tokenizer(tok), eos, source


def tensor_bytes(x: Any) -> int:
    """Bytes of every tensor inside `x` (tensors, quantized tensor subclasses, tuples,
    lists, dicts): what a QuantizedCache layer holds in codes, scales and zeros."""
    if isinstance(x, torch.Tensor):
        flatten = getattr(x, "__tensor_flatten__", None)
        if flatten is not None and type(x) is not torch.Tensor:
            return sum(tensor_bytes(getattr(x, n)) for n in flatten()[0])
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(tensor_bytes(v) for v in x.values())
    if isinstance(x, tuple | list):
        return sum(tensor_bytes(v) for v in x)
    return 0


def dynamo_summary() -> dict[str, Any]:
    """This process's compiles: graphs, recompiles, graph breaks and the first break's
    reason (a compiled arm that breaks its graph runs partly eager: the row must say so)."""
    from torch._dynamo.utils import counters

    breaks = dict(counters.get("graph_break", {}))
    first = next(iter(breaks), None)
    return {"unique_graphs": counters["stats"].get("unique_graphs", 0),
            "recompiles": sum(counters.get("recompiles", {}).values()),
            "graph_breaks": sum(breaks.values()),
            "first_break": first.splitlines()[0][:160] if first else None}


class TransformersEngine(TextEngine, Engine):
    """transformers in process (see the module docstring for arms, phases and counters)."""

    name = "transformers"
    modules = ("transformers",)
    install = "pip install 'kvtax[hf]'"

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.arm = parse_kv(spec.kv)
        if spec.path not in PATHS:
            raise KVTaxError(f"transformers has no path {spec.path!r}; use {', '.join(PATHS)}")
        self.model: Any = None
        self.cache: Any = None
        self.facts: dict[str, Any] = {}
        self.requant = {"prefill": 0, "decode": 0}
        self._stack = contextlib.ExitStack()
        self._tok: torch.Tensor | None = None
        self._pos = 0
        self._phase = "prefill"

    @classmethod
    def arms(cls, kvs: list[str], paths: list[str]) -> list[tuple[str, str]]:
        return cls.checked_product("transformers", kvs, paths, parse_kv, PATHS)

    @classmethod
    def default_kvs(cls) -> list[str]:
        return ["dynamic", "kvtax-int8", "kvtax-int4"]

    @classmethod
    def default_paths(cls) -> list[str]:
        return ["eager"]

    @classmethod
    def baseline_arm(cls, arms: list[tuple[str, str]]) -> tuple[str, str] | None:
        # The unquantized caches, eager first: dynamic/compiled can never run.
        for arm in (("dynamic", "eager"), ("static", "eager"), ("static", "compiled")):
            if arm in arms:
                return arm
        return arms[0] if arms else None

    def version(self) -> str:
        from importlib.metadata import version

        return f"transformers {version('transformers')}, torch {torch.__version__}"

    # ---- setup

    def load(self) -> None:
        from kvtax.harness.dtypes import torch_dtype

        why = arm_unavailable(self.arm, self.spec.path, self.spec.model)
        if why:
            raise EngineUnavailable(why)
        if self.spec.threads:
            torch.set_num_threads(int(self.spec.threads))
        self.device = torch.device(self.spec.device)
        self.dtype = torch_dtype(self.spec.dtype)
        if self.arm.kind == "quanto":
            from kvtax.harness.bench.hf_quantized import prepare_quanto

            self.facts["quanto_unpack"] = prepare_quanto(self.device)  # builds: not timed
        self.model, self.text, self.eos, source = load_hf(
            self.spec.model, self.dtype, self.device, self.spec.seed)
        self.facts["model_source"] = source
        if self.arm.kind == "kvtax":
            import kvtax.hf as kh

            self._stack.enter_context(kh.installed(self.model))
        from kvtax.hf.cache import cache_kwarg

        self.arg = cache_kwarg(self.model)
        self.step_call = self.model
        if self.spec.path == "compiled":
            self.step_call = self._compiled_call()
            self._warm_compiled()

    def _warm_compiled(self) -> None:
        """Compile in setup: dynamo specializes on the first step and recompiles once a
        cache count changes, so a few untimed steps run before any timed window."""
        t0 = time.perf_counter()
        self.prefill(self.prompt_ids(min(16, self._capacity(16) - WARM_STEPS - 1), 0))
        self.decode(WARM_STEPS)
        self.reset()
        self.facts["compile"]["warmup_s"] = round(time.perf_counter() - t0, 3)

    def _compiled_call(self) -> Any:
        from transformers import CompileConfig

        opts = self.spec.options
        cc = CompileConfig(fullgraph=False)
        cc.mode = str(opts.get("compile_mode", cc.mode))
        cc.backend = str(opts.get("compile_backend", cc.backend))
        cc._compile_all_devices = self.device.type != "cuda"  # CPU compiles only when asked
        self.facts["compile"] = {"mode": cc.mode, "backend": cc.backend, "fullgraph": False}
        from torch._dynamo.utils import counters

        counters.clear()  # this cell's compiles only
        return self.model.get_compiled_call(cc)

    def _text_cfg(self) -> Any:
        return self.model.config.get_text_config(decoder=True)

    def _capacity(self, tokens: int) -> int:
        return max(int(self.spec.capacity or 0), tokens)

    def _new_cache(self, tokens: int) -> Any:
        """An empty cache of this arm for at least `tokens` tokens; a preallocated one is
        reused (reset) when big enough, so compiled graphs keep its storage."""
        from transformers import DynamicCache, QuantizedCache, StaticCache

        kind, cfg = self.arm.kind, self.model.config
        old = self.cache
        if kind in COMPILEABLE and old is not None and self._held(old) >= tokens:
            old.reset()
            return old
        if kind == "dynamic":
            return DynamicCache(config=cfg)
        if kind == "static":
            return StaticCache(config=cfg, max_cache_len=self._capacity(tokens))
        if kind == "kvtax":
            import kvtax.hf as kh

            return kh.KVTaxCache(cfg, kv=self.arm.fmt, max_cache_len=self._capacity(tokens)
                                 if self.spec.path == "compiled" else None)
        from kvtax.harness.bench.hf_quantized import RESIDUAL_LENGTH

        if kind == "fp8":
            cache = QuantizedCache(backend="fp8", config=cfg)
        else:
            cache = QuantizedCache(backend=kind, config=cfg, nbits=self.arm.bits,
                                   q_group_size=self.arm.group, residual_length=RESIDUAL_LENGTH)
        self._count_requant(cache)
        return cache

    def _held(self, cache: Any) -> int:
        cap = getattr(cache, "capacity", None) or getattr(cache, "max_cache_len", None)
        return int(cap or 0)

    def _count_requant(self, cache: Any) -> None:
        """Count re-quantizations of a whole layer (QuantizedCache flushing its residual)."""
        for layer in cache.layers:
            orig = getattr(layer, "_quantize", None)
            if orig is None or self.arm.kind == "fp8":  # fp8 appends; it never re-quantizes
                continue

            def counted(*args: Any, _orig: Any = orig, **kw: Any) -> Any:
                self.requant[self._phase] += 1
                return _orig(*args, **kw)

            layer._quantize = counted

    # ---- measured work

    def _forward(self, call: Any, x: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Logits [tokens kept, vocab] of `x` [1, tokens] at the next positions."""
        pos = torch.arange(self._pos, self._pos + x.shape[1], device=self.device)[None]
        out = call(input_ids=x, position_ids=pos, use_cache=True, logits_to_keep=keep,
                   **{self.arg: self.cache})
        self._pos += x.shape[1]
        return out.logits[0]

    def prompt_ids(self, n: int, seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, int(self._text_cfg().vocab_size), (n,), generator=gen).tolist()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _prefill_logits(self, ids: list[int], keep: int = 1) -> torch.Tensor:
        """`ids` through a fresh cache in `chunk_size` chunks; logits [keep, vocab] of the
        last `keep` positions (keep <= len(ids))."""
        if not ids:
            raise KVTaxError("transformers: an empty prompt")
        self.reset()
        self.cache = self._new_cache(len(ids) + 1)
        self._phase = "prefill"
        x = torch.tensor([ids], device=self.device)
        step, kept = max(1, int(self.spec.chunk_size)), []
        for s in range(0, len(ids), step):
            e = min(s + step, len(ids))
            need = keep - (len(ids) - e)  # positions of this chunk among the last `keep`
            logits = self._forward(self.model, x[:, s:e], keep=max(1, min(e - s, need)))
            if need > 0:
                kept.append(logits)
        return torch.cat(kept)[-keep:]

    def prefill(self, ids: list[int]) -> None:
        self._tok = self._prefill_logits(ids)[-1:].argmax(-1, keepdim=True)
        self._sync()

    @torch.inference_mode()
    def decode(self, n: int) -> list[float]:
        if self._tok is None:
            raise KVTaxError("transformers: decode before prefill")
        self._phase, ms = "decode", []
        for _ in range(n):
            t0 = time.perf_counter()
            self._tok = self._forward(self.step_call, self._tok)[-1:].argmax(-1, keepdim=True)
            self._sync()
            ms.append((time.perf_counter() - t0) * 1e3)
        return ms

    def last_token(self) -> int:
        assert self._tok is not None
        return int(self._tok.item())

    def memory_counter(self) -> MemoryCounter:
        from kvtax.harness.engines.counters import CudaCounter, RssCounter

        return CudaCounter(str(self.device)) if self.device.type == "cuda" else RssCounter()

    def cache_bytes(self) -> int | None:
        """Resident K/V bytes: kvtax's own count; a QuantizedCache's codes, scales and fp
        residual; a Dynamic/StaticCache's K and V tensors."""
        if self.cache is None:
            return None
        if self.arm.kind == "kvtax":
            return int(self.cache.nbytes)
        names = ("_quantized_keys", "_quantized_values", "keys", "values")
        return sum(tensor_bytes(getattr(layer, n, None)) for layer in self.cache.layers
                   for n in names)

    def bytes_per_token(self) -> int | None:
        """K/V bytes one token adds over the full-attention layers, in the arm's format
        (QuantizedCache: its nominal codes + scale + zero per group, residual aside)."""
        from kvtax.formats.hybrid import HybridSpec, parse_kv as parse_format
        from kvtax.hf.cache import layer_windows

        cfg = self._text_cfg()
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        full = sum(1 for w in layer_windows(self.model.config) if w is None)
        size, arm = self.dtype.itemsize, self.arm
        if arm.kind == "kvtax":  # a hybrid format: its body's (fp16 sinks / recent are fixed)
            spec = parse_format(str(arm.fmt))
            one = (spec.base if isinstance(spec, HybridSpec) else spec).bytes_per_token(
                d, self.dtype)
        elif arm.kind == "fp8":
            one = 2 * d
        elif arm.bits is not None and arm.group is not None:  # codes + scale + zero, K and V
            one = 2 * (d * arm.bits // 8 + 2 * -(-d // arm.group) * size)
        else:
            one = 2 * d * size
        return int(one * cfg.num_key_value_heads * full)

    def info(self) -> dict[str, Any]:
        n_layers = len(self.cache.layers) if self.cache is not None else 0
        out = dict(self.facts, cache=type(self.cache).__name__ if self.cache else None,
                   attn_implementation=getattr(self.model.config, "_attn_implementation", None)
                   if self.model is not None else None)
        if self.arm.kind in ("quanto", "hqq"):
            from kvtax.harness.bench.hf_quantized import RESIDUAL_LENGTH

            out.update(nbits=self.arm.bits, q_group_size=self.arm.group,
                       residual_length=RESIDUAL_LENGTH)
            if n_layers:  # one growth event = one re-quantization of every layer's K and V
                out["prefill_growth_events"] = self.requant["prefill"] // (2 * n_layers)
                out["decode_growth_events"] = self.requant["decode"] // (2 * n_layers)
        if self.spec.path == "compiled":
            out["dynamo"] = dynamo_summary()
        return out

    def reset(self) -> None:
        if self.cache is not None and self.arm.kind not in COMPILEABLE:
            self.cache = None
        self._tok, self._pos = None, 0
        self.requant = {"prefill": 0, "decode": 0}
        self._phase = "prefill"

    @torch.inference_mode()
    def logprobs(self, ids: list[int], tail: int) -> torch.Tensor:
        """Teacher-forced log-probabilities [tail, vocab] (float32): row i predicts
        ids[len(ids) - tail + i], every position read through this arm's cache."""
        if not 0 < tail < len(ids):
            raise KVTaxError(f"transformers logprobs: tail {tail} must be in 1..{len(ids) - 1}")
        logits = self._prefill_logits(ids[:-1], keep=tail)  # the cache stays: cache_bytes()
        return torch.log_softmax(logits.float(), -1).cpu()

    def close(self) -> None:
        self._stack.close()
        self.model = self.cache = self._tok = None


ENGINE = TransformersEngine
