"""What one cell measures, inside its worker process.

Two levels share one timeline — setup, prefill, decode — each phase with its own peak:

- model level: a whole decoder through `kvtax.models.Runner` (chunked prefill, then
  `decode_tokens` greedy steps with EOS ignored), the same runner for every path: on CUDA
  with a presized cache each path's decode step is captured in a CUDA graph (the row's
  `cuda_graph` says whether it was, `graph_off_reason` why not);
- attention level: one layer's cache and the attention op alone over it (chunked append
  + attention for prefill, append-one + attention per decode step).

Returned fields are the bench-row keys of `kvtax.harness.schema` (plus a few extras such
as `memory_kind`, `prefill_growth`, `decode_growth_events`, and `sdpa_backend`: the torch
SDPA backend the fp16 / dequant baselines' decode dispatched to).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvtax.cache import BaseCache, FullCache, make_caches
from kvtax.formats import KVSpec
from kvtax.formats.hybrid import HybridSpec, parse_kv
from kvtax.attention.baselines import attention_for, sdpa_backend
from kvtax.harness.bench.hooks import use_sdpa_backend
from kvtax.harness.bench.timeline import (
    WARMUP_TOKENS,
    PhaseHook,
    Timeline,
    decode_loop,
    finish_decode,
    sync,
)
from kvtax.harness.dtypes import torch_dtype
from kvtax.harness.kv_arm import parse_arm

def _growths(caches: list[BaseCache]) -> int:
    return sum(c.growth_events for c in caches)


# ----------------------------------------------------------------------------- attention


def layer_shape(cell: dict[str, Any]) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim): the model config's when the model is built in."""
    try:
        from kvtax.models import get_config

        cfg = get_config(cell["model"])
        assert cfg.head_dim is not None
        return cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    except (ImportError, KeyError):
        return int(cell["heads"]), int(cell["kv_heads"]), int(cell["head_dim"])


def attention_cell(
    cell: dict[str, Any], hook: PhaseHook | None = None, out: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One layer: prefill `context` tokens in chunks, then `decode_tokens` single steps."""
    device = torch.device(cell["device"])
    dtype = torch_dtype(cell["dtype"])
    tl = Timeline(device, hook, cell, out)
    tl.enter("setup")
    hq, hkv, d = layer_shape(cell)
    b, ctx, n_dec = int(cell["batch"]), int(cell["context"]), int(cell["decode_tokens"])
    chunk = max(1, min(int(cell["chunk_size"]), ctx))
    spec = KVSpec.parse(cell["kv"])
    fn = attention_for(cell["path"])
    gen = torch.Generator(device=device).manual_seed(int(cell["seed"]))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    # One chunk of K/V/Q reused for every chunk: values do not change the cost, and the
    # prompt's K/V never need to exist all at once (they would inflate the prefill peak).
    k_c, v_c, q_c = rand(b, hkv, chunk, d), rand(b, hkv, chunk, d), rand(b, hq, chunk, d)
    k_1, v_1, q_1 = rand(b, hkv, 1, d), rand(b, hkv, 1, d), rand(b, hq, 1, d)
    capacity = ctx + n_dec + 1 if cell.get("presize") else None

    def prefill(cache: FullCache, n: int) -> None:
        done = 0
        while done < n:
            t = min(chunk, n - done)
            cache.append(k_c[:, :, :t], v_c[:, :, :t])
            fn(q_c[:, :, :t], cache.view())
            done += t

    def step(cache: FullCache) -> None:
        cache.append(k_1, v_1)
        fn(q_1, cache.view())

    if cell.get("extra", {}).get("inner_warmup", True):
        w = min(chunk, WARMUP_TOKENS)
        warm = FullCache(spec, capacity=w + 2 if cell.get("presize") else None)
        prefill(warm, w)
        step(warm)
        del warm
    cache = FullCache(spec, capacity=capacity)
    out = tl.out
    if "prefill" in cell["phases"]:
        tl.start("prefill")
        t0 = time.perf_counter()
        prefill(cache, ctx)
        sync(device)
        ttft = time.perf_counter() - t0
        tl.stop("prefill")
        out.update(ttft_s=ttft, prefill_tok_s=ctx / ttft if ttft > 0 else None)
    else:
        prefill(cache, ctx)
    out["cache_bytes"] = cache.nbytes
    out["cache_used_bytes"] = cache.used_nbytes
    out["bytes_per_token"] = spec.bytes_per_token(d, dtype) * hkv
    out["prefill_growth_events"] = cache.growth_events
    step(cache)  # settle: the first step after prefill pays one-off costs
    if "decode" in cell["phases"] and n_dec > 0:
        before = cache.growth_events
        tl.start("decode")
        samples = decode_loop(lambda: step(cache), n_dec, device)
        tl.stop("decode")
        finish_decode(out, samples)
        out["decode_growth_events"] = cache.growth_events - before
        out["decode_growth"] = cache.growth_events > before
    out["level"] = "attention"
    out["layer_shape"] = [hq, hkv, d]
    out["cuda_graph"] = False  # every path's op runs eagerly here, kvtax's included
    out["sdpa_backend"] = sdpa_backend(cell["path"], q_1, cache.view())
    return out


# ----------------------------------------------------------------------------- model


def model_cell(
    cell: dict[str, Any], hook: PhaseHook | None = None, out: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Whole decoder via the Runner: TTFT, prefill tok/s, decode ms/token, per-phase peaks."""
    from kvtax.harness.bench.hooks import use_attention
    from kvtax.models import Runner, load_model

    device = torch.device(cell["device"])
    dtype = torch_dtype(cell["dtype"])
    tl = Timeline(device, hook, cell, out)
    tl.enter("setup")
    path = cell["path"]
    kv = "fp16" if path == "fp16" else cell["kv"]
    b, ctx, n_dec = int(cell["batch"]), int(cell["context"]), int(cell["decode_tokens"])
    model = load_model(cell["model"], dtype=dtype, device=device, seed=int(cell["seed"]))
    cfg = model.config
    # Every path decodes in the same runner: the baselines too are captured (masked reads of
    # the presized storage, lengths from the device), so arms differ in attention alone.
    arm = parse_arm(kv)  # hybrid and per-layer caches: the runner's own (kv_arm grammar)
    runner = Runner(model, kv=arm.base, overrides=arm.layers or None,
                    chunk_size=int(cell["chunk_size"]), cuda_graph=cell.get("cuda_graph"))
    gen = torch.Generator(device="cpu").manual_seed(int(cell["seed"]))
    ids = torch.randint(0, cfg.vocab_size, (b, ctx), generator=gen).to(device)
    capacity = ctx + n_dec + 2 if cell.get("presize") else None
    q_start = int(cell.get("quantized_kv_start") or 0)
    if q_start and not arm.is_plain:
        raise ValueError("quantized_kv_start converts into one plain format; use 0 with "
                         f"{kv}")
    spec = parse_kv(arm.base)
    out = tl.out

    def make(spec_name: str, cap: int | None) -> list[BaseCache]:
        if spec_name == kv:
            return runner.make_caches(capacity=cap)
        return make_caches(cfg.layer_windows(), spec_name, capacity=cap)

    with use_attention(model, attention_for(path)), torch.inference_mode():
        if cell.get("extra", {}).get("inner_warmup", True):
            _warm_up(runner, ids, cell, lambda cap: make(kv, cap))

        def run_prefill() -> tuple[list[BaseCache], torch.Tensor]:
            if q_start > 0 and spec.is_quantized:
                # mlx-lm's quantized_kv_start: the first tokens go into an fp16 cache that is
                # converted to the quantized format once the prompt passes `q_start`.
                split = min(q_start, ctx)
                caches = make("fp16", None)
                logits = runner.prefill(ids[:, :split], caches)
                caches = convert_caches(caches, kv, capacity)
                if split < ctx:
                    logits = runner.prefill(ids[:, split:], caches)
                return caches, logits
            caches = make(kv, capacity)
            return caches, runner.prefill(ids, caches)

        if "prefill" in cell["phases"]:
            tl.start("prefill")
            t0 = time.perf_counter()
            caches, logits = run_prefill()
            sync(device)
            ttft = time.perf_counter() - t0
            tl.stop("prefill")
            out.update(ttft_s=ttft, prefill_tok_s=b * ctx / ttft if ttft > 0 else None)
        else:
            caches, logits = run_prefill()
        out["cache_bytes"] = sum(c.nbytes for c in caches)
        out["cache_used_bytes"] = sum(c.used_nbytes for c in caches)
        out["bytes_per_token"] = model_bytes_per_token(cfg, spec, dtype, arm.layers)
        out["prefill_growth_events"] = _growths(caches)
        tok = logits.argmax(-1, keepdim=True)  # EOS ignored: greedy tokens, whatever they are
        # greedy steps: on CUDA the argmax is captured with the step (one replay a token)
        tok = runner.decode_greedy(tok, caches)  # settle step
        if "decode" in cell["phases"] and n_dec > 0:
            _measure_decode(runner, caches, tok, n_dec, tl)
        graph = bool(runner.cuda_graph and runner.graph_disabled_reason is None)
        out["sdpa_backend"] = decode_sdpa_backend(path, caches, cfg, dtype, graph)
    out["level"] = "model"
    out["cuda_graph"] = graph
    out["graph_off_reason"] = runner.graph_disabled_reason
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def _warm_up(runner: Any, ids: torch.Tensor, cell: dict[str, Any],
             make: Callable[[int | None], list[BaseCache]]) -> None:
    """An untimed short prompt and one greedy step over caches of their own, so one-off
    costs (kernel compilation, graph capture) land outside every measured window."""
    w = min(int(cell["context"]), int(cell["chunk_size"]), WARMUP_TOKENS)
    warm = make(w + 2 if cell.get("presize") else None)
    logits = runner.prefill(ids[:, :w], warm)
    runner.decode_greedy(logits.argmax(-1, keepdim=True), warm)
    del warm, logits
    runner.release_graph()  # the measured caches get their own graph


def _measure_decode(runner: Any, caches: list[BaseCache], tok: torch.Tensor, n: int,
                    tl: Timeline) -> None:
    """`n` timed greedy steps from `tok` `[B, 1]`: the decode fields of `tl.out`."""
    state = {"tok": tok}

    def step() -> None:
        state["tok"] = runner.decode_greedy(state["tok"], caches)

    before = _growths(caches)
    tl.start("decode")
    samples = decode_loop(step, n, tl.device)
    tl.stop("decode")
    finish_decode(tl.out, samples)
    tl.out["decode_growth_events"] = _growths(caches) - before
    tl.out["decode_growth"] = _growths(caches) > before


def decode_sdpa_backend(
    path: str, caches: list[BaseCache], cfg: Any, dtype: torch.dtype, captured: bool,
    fold_gqa: bool = False,
) -> str | None:
    """The SDPA backend a decode step of `path` dispatched to over a global layer's cache
    (its captured, masked form when `captured`); None for paths without SDPA."""
    if path not in ("fp16", "dequant"):  # the others call no SDPA (and may read hybrids)
        return None
    cache = next((c for c in caches if getattr(c, "window", None) is None), caches[0])
    view = cache.view()
    if captured:
        lens = torch.full((view.batch,), view.length, dtype=torch.int32, device=view.device)
        view = dataclasses.replace(view, length_t=lens)
    q = torch.empty(view.batch, cfg.num_heads, 1, view.head_dim, dtype=dtype, device=view.device)
    return sdpa_backend(path, q, view, fold_gqa)


def model_bytes_per_token(cfg: Any, spec: "KVSpec | HybridSpec", dtype: torch.dtype,
                          overrides: Mapping[int, str] | None = None) -> int:
    """K+V bytes one token adds across all layers (sliding layers included); `overrides`:
    layer index → format. A hybrid layer's token adds one body row (its fp16 sinks and
    recent window are a fixed size)."""
    assert cfg.head_dim is not None
    total = 0
    for i in range(cfg.num_layers):
        s = parse_kv(overrides[i]) if overrides and i in overrides else spec
        body = s.base if isinstance(s, HybridSpec) else s
        total += body.bytes_per_token(cfg.head_dim, dtype) * cfg.num_kv_heads
    return total


def convert_caches(
    caches: list[BaseCache], spec: str, capacity: int | None
) -> list[BaseCache]:
    """Re-encode fp16 caches into `spec` (what mlx-lm's `to_quantized` does mid-prompt)."""
    out: list[BaseCache] = []
    for c in caches:
        if getattr(c, "window", None) is not None:
            raise ValueError(
                "quantized_kv_start with sliding-window layers is not supported (mlx-lm "
                "cannot quantize its RotatingKVCache either); use quantized_kv_start 0"
            )
        view = c.view()
        k = view.k.codes[:, :, : view.length].to(view.dtype)  # fp16 codes are the values
        v = view.v.codes[:, :, : view.length].to(view.dtype)
        new = FullCache(spec, capacity=capacity)
        new.append(k, v)
        out.append(new)
    return out


def run_cell(
    cell: dict[str, Any], hook: PhaseHook | None = None, out: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Dispatch on `cell["engine"]` (another stack: the generic engine cell), then on
    `cell["level"]` (and the hf-quantized path, which runs transformers' own model and
    cache); `out` receives results phase by phase."""
    if cell.get("engine", "kvtax") != "kvtax":
        from kvtax.harness.bench.engine_cell import engine_cell

        return engine_cell(cell, hook, out)
    if out is not None:
        from kvtax import __version__

        out["engine_version"] = f"kvtax {__version__}"
    if cell.get("path") == "hf-quantized" and cell.get("level", "model") == "model":
        from kvtax.harness.bench.hf_quantized import hf_quantized_cell

        return hf_quantized_cell(cell, hook, out)
    # extra.sdpa_backend pins the backend the fp16 / dequant baselines' SDPA calls use
    with use_sdpa_backend(str(cell.get("extra", {}).get("sdpa_backend", "auto"))):
        if cell.get("level", "model") == "attention":
            return attention_cell(cell, hook, out)
        return model_cell(cell, hook, out)
