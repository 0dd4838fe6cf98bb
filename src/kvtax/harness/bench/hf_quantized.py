"""The `hf-quantized` arm: transformers' own `QuantizedCache` (quanto backend), measured in a cell.

What a transformers user gets from `QuantizedCache(backend="quanto")`: a stock HF model
(built from the same shapes as kvtax's built-in config, random weights; or a local HF
folder / hub id) whose cache keeps K/V quantized and dequantizes all of it at every
forward. The cell drives `model(...)` itself — prefill in `chunk_size` chunks, then
greedy decode steps with EOS ignored — so its phases, peaks and timings are the same as
every other arm's (`kvtax.harness.bench.timeline`). `kvtax bench --engine transformers --kv
quanto-int4` (harness/engines/transformers_engine.py) measures the same cache with the
same settings and reuses this module's helpers, so this arm can move there.

    >>> hf_quantized_unavailable("int4")          # None: the arm can run here
    >>> row = hf_quantized_cell(cell, hook, out)   # called by cells.run_cell

quanto and CUDA: on the first dequantize, quanto JIT-compiles its whole CUDA extension
(Marlin/AWQ GEMMs too: minutes of nvcc). The KV cache needs only its `unpack` kernel, so
`prepare_quanto` builds that one kernel from quanto's own source (tens of seconds, cached
on disk) and hands it to quanto; if nvcc is missing it falls back to the pure-torch unpack
that quanto itself registers for other devices. The row records which one ran.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from pathlib import Path
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from kvtax.harness.bench.timeline import (
    WARMUP_TOKENS,
    Timeline,
    decode_loop,
    finish_decode,
    sync,
)
from kvtax.harness.dtypes import torch_dtype

QUANTO_BITS = (2, 4)
RESIDUAL_LENGTH = 128  # transformers' default: the newest tokens kept unquantized

_HF_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3": "gemma3_text"}
_HF_ACT = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


# ----------------------------------------------------------------------------- availability


def hf_quantized_unavailable(kv: str | None = None, model: str | None = None) -> str | None:
    """Why the arm cannot run for format `kv` on `model` here (None when it can).

    Checked without importing quanto (the sweep's parent process stays light): the
    package is found, transformers has QuantizedCache, the format is a same-K/V integer
    format quanto supports (2 or 4 bits), and a built-in model has no sliding layers
    (QuantizedCache rejects them).
    """
    try:
        from transformers import QuantizedCache  # noqa: F401
    except ImportError as exc:
        return f"transformers with QuantizedCache is not importable ({exc})"
    if importlib.util.find_spec("optimum") is None or not _find("optimum.quanto"):
        return ("transformers' QuantizedCache needs a backend: pip install optimum-quanto "
                "(the quanto backend is the one this arm drives); it is not installed")
    if kv is not None:
        from kvtax.formats import AffineFormat, KVSpec

        try:
            spec = KVSpec.parse(kv)
        except Exception as exc:  # a format name kvtax does not know
            return f"unknown format {kv!r} ({exc})"
        if spec.key != spec.value or not isinstance(spec.key, AffineFormat):
            return f"QuantizedCache has no {kv!r}: it stores K and V in one integer format"
        if spec.key.n_bits not in QUANTO_BITS:
            return (f"quanto's QuantizedCache supports {QUANTO_BITS} bits, not "
                    f"{spec.key.n_bits} ({kv})")
    if model is not None:
        windows = _builtin_windows(model)
        if windows and any(w is not None for w in windows):
            return (f"{model} has sliding-window layers, which transformers' QuantizedCache "
                    "rejects (full-attention models only)")
    return None


def _find(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _builtin_windows(model: str) -> list[int | None] | None:
    try:
        from kvtax.models import get_config

        return get_config(model).layer_windows()
    except (ImportError, KeyError):
        return None


# ----------------------------------------------------------------------------- quanto on CUDA

_PYBIND = """#include <torch/extension.h>
#include "unpack.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("unpack", &unpack, "unpack"); }
"""


def _torch_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """quanto's own device-agnostic unpack (its "default" kernel), for when nvcc is missing:
    value i of each byte is `(byte & (2^(bits(i+1)) - 1)) >> bits*i`, stacked along dim 0."""
    parts = [(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]
    return torch.cat(parts).to(torch.uint8)


def quanto_build_dir() -> Path:
    """Where the unpack-only CUDA build lives ($KVTAX_QUANTO_BUILD, else ~/.cache/kvtax)."""
    env = os.environ.get("KVTAX_QUANTO_BUILD")
    if env:
        return Path(env)
    tag = torch.__version__.replace("+", "_")
    return Path.home() / ".cache" / "kvtax" / f"quanto-unpack-{tag}"


def prepare_quanto(device: str | torch.device) -> str:
    """Import quanto and make its dequantize runnable on `device` without a minutes-long
    JIT build; returns how `unpack` will run (recorded on rows). Builds happen here, in
    setup, so no timed phase pays for them."""
    import optimum.quanto  # noqa: F401 - registers quanto's ops and extensions
    from optimum.quanto.library.extensions import extension as qext

    if torch.device(device).type != "cuda":
        try:
            ext = qext.get_extension("quanto_cpp")
        except KeyError:
            return "quanto default unpack (no CPU extension registered)"
        t0 = time.perf_counter()
        with _build_lock(Path(ext.build_directory)):
            ext.lib  # noqa: B018 - builds (once) and loads quanto's own CPU extension
        return f"quanto cpp extension (CPU; built/loaded in {time.perf_counter() - t0:.1f} s)"
    try:
        ext = qext.get_extension("quanto_cuda")
    except KeyError:
        return "quanto default unpack (no CUDA extension registered)"
    if ext._lib is not None:
        return getattr(ext, "_kvtax_unpack", "quanto CUDA extension")
    build = quanto_build_dir()
    root = Path(ext.sources[0]).parent
    binding = build / "unpack_pybind.cpp"
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        with _build_lock(build):
            if not binding.exists() or binding.read_text() != _PYBIND:
                binding.write_text(_PYBIND)
            ext._lib = load(
                name="quanto_cuda_unpack",
                sources=[str(root / "unpack.cu"), str(binding)],
                extra_cflags=["-O3"],
                extra_cuda_cflags=list(ext.extra_cuda_cflags or []),
                extra_include_paths=[str(root)],
                build_directory=str(build),
            )
        how = f"quanto CUDA unpack kernel (built/loaded in {time.perf_counter() - t0:.1f} s)"
    except Exception as exc:  # no nvcc, a compiler error: quanto's own torch path still works
        ext._lib = SimpleNamespace(unpack=_torch_unpack)
        how = f"quanto default torch unpack (CUDA build failed: {str(exc).splitlines()[0][:160]})"
    ext._kvtax_unpack = how
    return how


@contextlib.contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """Serialize builds in `build` across processes with a lock the kernel drops when its
    holder dies, and clear the lock file torch's builder leaves behind when a process is
    killed mid-build (a timed-out cell): without this every later load would wait forever."""
    import fcntl

    build.mkdir(parents=True, exist_ok=True)
    with open(build / "kvtax-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)  # torch's FileBaton: no live holder now
        yield


# ----------------------------------------------------------------------------- model


def hf_config(cfg: Any) -> Any:
    """A transformers config with the shapes and switches of a kvtax `ModelConfig`."""
    from transformers import AutoConfig

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    kw: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, hidden_act=_HF_ACT[cfg.hidden_act],
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_id) if cfg.eos_token_id else None,
        rope_parameters=rope,
    )
    if cfg.family == "gemma3":
        kw["rope_parameters"] = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
        }
    if cfg.family in ("llama", "mistral"):
        kw["attention_bias"] = bool(cfg.qkv_bias)
    if cfg.family in ("gemma2", "gemma3"):
        q = cfg.query_pre_attn_scalar  # transformers' config wants an int where it is one
        kw["query_pre_attn_scalar"] = int(q) if float(q).is_integer() else q
    if cfg.family == "gemma2":
        kw.update(attn_logit_softcapping=cfg.attn_softcap,
                  final_logit_softcapping=cfg.final_softcap)
    if cfg.sliding_window is not None:
        kw["sliding_window"] = cfg.sliding_window
        if cfg.family in ("qwen2", "qwen3"):
            kw["use_sliding_window"] = True
    elif cfg.family in ("mistral", "qwen2", "qwen3"):
        kw["sliding_window"] = None
    if cfg.layer_types is not None:
        kw["layer_types"] = list(cfg.layer_types)
    return AutoConfig.for_model(_HF_TYPES[cfg.family], **kw)


def build_hf_model(source: str, *, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """A transformers causal LM: a built-in config name (random weights, made on `device`),
    a local HF folder, or a hub id."""
    from transformers import AutoModelForCausalLM

    try:
        from kvtax.models import get_config

        cfg = hf_config(get_config(source))
    except KeyError:
        cfg = None
    if cfg is not None:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device)
    return model.eval().requires_grad_(False)


def quantized_cache_bytes(cache: Any) -> int:
    """Resident bytes of a QuantizedCache: quantized tensors (codes, scales, shifts) plus
    the unquantized residual, over all layers."""
    def nbytes(t: Any) -> int:
        if t is None or not isinstance(t, torch.Tensor):
            return 0
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None and type(t) is not torch.Tensor:
            names, _ = flatten()
            return sum(nbytes(getattr(t, n)) for n in names)
        return t.numel() * t.element_size()

    total = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values", "keys", "values"):
            total += nbytes(getattr(layer, name, None))
    return total


# ----------------------------------------------------------------------------- the cell


def hf_quantized_cell(
    cell: dict[str, Any], hook: Any = None, out: dict[str, Any] | None = None
) -> dict[str, Any]:
    """transformers + QuantizedCache(quanto): TTFT, decode ms/token, per-phase peaks."""
    from kvtax.formats import KVSpec
    from kvtax.hf.cache import cache_kwarg

    device = torch.device(cell["device"])
    dtype = torch_dtype(cell["dtype"])
    tl = Timeline(device, hook, cell, out)
    tl.enter("setup")
    kv = cell["kv"]
    why = hf_quantized_unavailable(kv, cell["model"])
    if why:
        raise RuntimeError(f"hf-quantized cannot run: {why}")
    if int(cell.get("quantized_kv_start") or 0):
        raise ValueError("quantized_kv_start does not apply to QuantizedCache (its residual "
                         f"of {RESIDUAL_LENGTH} fp tokens is its own delay); use 0")
    spec = KVSpec.parse(kv)
    out = tl.out
    out["quanto_unpack"] = prepare_quanto(device)
    model = build_hf_model(cell["model"], dtype=dtype, device=device, seed=int(cell["seed"]))
    text = model.config.get_text_config(decoder=True)
    arg = cache_kwarg(model)
    b, ctx, n_dec = int(cell["batch"]), int(cell["context"]), int(cell["decode_tokens"])
    chunk = max(1, min(int(cell["chunk_size"]), ctx))
    gen = torch.Generator(device="cpu").manual_seed(int(cell["seed"]))
    ids = torch.randint(0, text.vocab_size, (b, ctx), generator=gen).to(device)
    flushes = {"n": 0}

    def make_cache() -> Any:
        return _counted_cache(model, spec, flushes)

    def forward(x: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(input_ids=x, use_cache=True, logits_to_keep=1, **{arg: cache}).logits[:, -1]

    def prefill(cache: Any, n: int) -> torch.Tensor:
        logits = None
        for s in range(0, n, chunk):
            logits = forward(ids[:, s:min(n, s + chunk)], cache)
        assert logits is not None
        return logits

    with torch.inference_mode():
        if cell.get("extra", {}).get("inner_warmup", True):
            warm = make_cache()
            logits = prefill(warm, min(ctx, chunk, WARMUP_TOKENS))
            forward(logits.argmax(-1, keepdim=True), warm)
            del warm, logits
        flushes["n"] = 0
        if "prefill" in cell["phases"]:
            tl.start("prefill")
            t0 = time.perf_counter()
            cache = make_cache()
            logits = prefill(cache, ctx)
            sync(device)
            ttft = time.perf_counter() - t0
            tl.stop("prefill")
            out.update(ttft_s=ttft, prefill_tok_s=b * ctx / ttft if ttft > 0 else None)
        else:
            cache = make_cache()
            logits = prefill(cache, ctx)
        n_layers = len(cache.layers)
        out["cache_bytes"] = out["cache_used_bytes"] = quantized_cache_bytes(cache)
        out["bytes_per_token"] = (spec.bytes_per_token(int(text.head_dim), dtype)
                                  * int(text.num_key_value_heads) * n_layers)
        # One "growth" = one re-quantization of every layer's K and V (residual flush).
        out["prefill_growth_events"] = flushes["n"] // (2 * n_layers)
        tok = logits.argmax(-1, keepdim=True)
        tok = forward(tok, cache).argmax(-1, keepdim=True)  # settle step
        if "decode" in cell["phases"] and n_dec > 0:
            _timed_decode(lambda t: forward(t, cache), tok, n_dec, tl, flushes, n_layers)
    out.update(
        level="model", engine="transformers", cuda_graph=False, presized=False,
        hf_cache=(f"QuantizedCache(quanto, nbits={spec.key.n_bits}, "
                  f"q_group_size={spec.key.group_size}, residual_length={RESIDUAL_LENGTH})"),
        hf_attn_implementation=getattr(model.config, "_attn_implementation", None),
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
    )
    return out


def _counted_cache(model: Any, spec: Any, flushes: dict[str, int]) -> Any:
    """transformers' QuantizedCache (quanto) for `spec` (a KVSpec of one int format), each
    re-quantization of a layer's K or V counted in `flushes["n"]`."""
    from transformers import QuantizedCache

    cache = QuantizedCache(backend="quanto", config=model.config, nbits=spec.key.n_bits,
                           q_group_size=spec.key.group_size, residual_length=RESIDUAL_LENGTH)
    for layer in cache.layers:  # count re-quantizations of the whole layer (K and V)
        orig = layer._quantize

        def counted(tensor: torch.Tensor, axis: int, _orig: Any = orig) -> Any:
            flushes["n"] += 1
            return _orig(tensor, axis)

        layer._quantize = counted
    return cache


def _timed_decode(forward: Any, tok: torch.Tensor, n: int, tl: Timeline, flushes: dict[str, int],
                  n_layers: int) -> None:
    """`n` timed greedy steps from `tok` `[B, 1]` (`forward(tok)` → logits `[B, V]`): the
    decode fields of `tl.out`, a growth being one residual flush of every layer."""
    state = {"tok": tok}

    def step() -> None:
        state["tok"] = forward(state["tok"]).argmax(-1, keepdim=True)

    before = flushes["n"]
    tl.start("decode")
    samples = decode_loop(step, n, tl.device)
    tl.stop("decode")
    finish_decode(tl.out, samples)
    events = (flushes["n"] - before) // (2 * n_layers)
    tl.out["decode_growth_events"] = events
    tl.out["decode_growth"] = events > 0
