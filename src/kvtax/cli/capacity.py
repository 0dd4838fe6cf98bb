"""`kvtax capacity`: tokens of KV cache that fit a memory reservation, per format.

Bytes per token count K and V of every layer and KV head; the codes, scales and biases
columns split them by what is stored (scales and biases in the model dtype: fp8 keeps a
scale per token and KV head, fp8-pt one per tensor, as vLLM's default fp8 KV cache does).
A sliding-window layer never holds more than its window. With a device's memory
(--device-memory, or the free memory of --device cuda) it also prints the longest context
that fits beside the weights.

Example (the 13.37 GiB KV reservation vLLM reported for Llama-3.1-8B, where it fit 109,504
fp16 tokens and 219,008 fp8 ones):
  kvtax capacity --model llama-3.1-8b --reserve 13.37GiB --kv fp16,int8,int4,fp8,fp8-pt
  kvtax capacity --model llama-3.1-8b --device-memory 141GiB
  kvtax capacity --from-run runs/20260101T000000Z-bench-tiny --reserve 1GiB
"""

from __future__ import annotations

import argparse

from kvtax.cli.validate import at_least, size
from kvtax.errors import OptionError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "capacity",
        help="tokens of KV cache that fit a reservation (and a device) per format",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="llama-3.1-8b",
                   help="built-in config name, local HF folder, .gguf file or hub id (only its "
                        "config is read; default llama-3.1-8b)")
    p.add_argument("--reserve", type=size, default=None,
                   help="KV memory reservation with its unit, e.g. 13.37GiB (GiB = 2^30, "
                        "GB = 10^9, B = bytes; a bare number is refused)")
    p.add_argument("--kv", default="fp16,int8,int4,fp8,fp8-pt",
                   help="formats to compare (default fp16,int8,int4,fp8,fp8-pt)")
    p.add_argument("--sliding-kv", default=None,
                   help="format of sliding-window layers (default: same as --kv)")
    p.add_argument("--dtype", default="bfloat16",
                   help="model dtype: scales are stored in it, weights too (default bfloat16)")
    p.add_argument("--device-memory", type=size, default=None,
                   help="device memory for the longest-context column, e.g. 141GiB")
    p.add_argument("--device", default=None,
                   help="read free memory from this CUDA device instead (e.g. cuda)")
    p.add_argument("--overhead", type=size, default=0,
                   help="memory kept for activations/workspace beside weights, e.g. 2GiB "
                        "(default 0)")
    p.add_argument("--batch", type=at_least(1), default=1, help="sequences sharing the memory (1)")
    p.add_argument("--from-run", metavar="RUN_DIR", default=None,
                   help="use bytes per token measured in a bench run instead of the config")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtax.cli.validate import check_formats, check_model
    from kvtax.harness.bench.plan import resolve_kv
    from kvtax.formats.hybrid import HybridSpec
    from kvtax.harness.analysis import capacity as cap
    from kvtax.harness.dtypes import torch_dtype

    if not args.reserve and not args.device_memory and not args.device:
        raise OptionError("give --reserve and/or --device-memory (or --device cuda)")
    reserve, overhead = args.reserve, args.overhead
    if args.from_run:
        return _from_run(args.from_run, reserve)
    names = [s.strip() for s in args.kv.split(",") if s.strip()]
    check_formats(names, hybrid=True)
    if args.sliding_kv:
        check_formats([args.sliding_kv], "--sliding-kv", hybrid=True)
    try:
        dtype = torch_dtype(args.dtype)
    except ValueError as exc:
        raise OptionError(f"--dtype: {exc}") from None
    cfg = check_model(args.model)
    specs = [resolve_kv(name, cfg.head_dim) for name in names]  # group sizes fit head_dim
    sliding = (resolve_kv(args.sliding_kv, cfg.head_dim, "--sliding-kv")
               if args.sliding_kv else None)
    fixed = any(isinstance(s, HybridSpec) for s in specs)
    itemsize = 2 if dtype != torch_dtype("float32") else 4
    weights = cfg.weight_params() * itemsize
    device_bytes = _device_bytes(args)
    print(f"model {cfg.name}: {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x "
          f"{cfg.head_dim}, weights {cap.format_size(weights)} in {args.dtype}"
          + (f"; reservation {cap.format_size(reserve)}" if reserve else "")
          + (f"; device {cap.format_size(device_bytes)}" if device_bytes else ""))
    w = max(10, *(len(s.name) + 1 for s in specs))
    head = f"{'format':<{w}}{'bytes/token':>13}{'codes':>9}{'scales':>8}{'biases':>8}"
    if fixed:
        head += f"{'fixed':>11}"
    if reserve:
        head += f"{'tokens in reserve':>19}{'vs first':>10}"
    if device_bytes:
        head += f"{'longest context':>17}"
    print(head)
    first = None
    for spec in specs:
        lay = cap.kv_layout(cfg, spec, dtype, sliding)
        codes, scales, biases = cap.token_parts(cfg, spec, dtype, sliding)
        line = f"{spec.name:<{w}}{lay.per_token:>13,}{codes:>9,}{scales:>8,}{biases:>8,}"
        if fixed:
            line += f"{cap.format_size(lay.fixed_bytes) if lay.fixed else '-':>11}"
        if reserve:
            n = cap.tokens_fitting(reserve, lay, args.batch)
            first = first or n
            shown = "unbounded" if n == cap.UNBOUNDED else f"{n:,}"
            ratio = "" if n == cap.UNBOUNDED or not first else f"{n / first:.2f}x"
            line += f"{shown:>19}{ratio:>10}"
        if device_bytes:
            n = cap.longest_context(device_bytes, weights, lay, overhead, args.batch)
            line += f"{'unbounded' if n == cap.UNBOUNDED else format(n, ','):>17}"
        print(line)
    print("(bytes per token over all layers and KV heads; codes, scales and biases are its "
          "parts. fp8: a scale per token and KV head; fp8-pt: one per tensor, none per token)")
    if device_bytes:
        print(f"(the model's trained maximum is {cfg.max_position_embeddings:,} positions; "
              f"overhead kept: {cap.format_size(overhead)})")
    if fixed:
        print("(fixed: a hybrid spec's fp16 sinks and recent tokens, int8 with `i8`, over all "
              "layers once the context holds them; its quantized body stores every token)")
    if cfg.layer_windows().count(None) != cfg.num_layers:
        print("(sliding-window layers are counted at most at their window)")
    return 0


def _device_bytes(args: argparse.Namespace) -> int | None:
    if args.device_memory:
        return int(args.device_memory)
    if args.device:
        import torch

        if not torch.cuda.is_available():
            raise OptionError(f"--device {args.device}: torch sees no CUDA device; give "
                              "--device-memory instead")
        free, _total = torch.cuda.mem_get_info(torch.device(args.device))
        return int(free)
    return None


def _from_run(run_dir: str, reserve: int | None) -> int:
    from kvtax.harness.analysis import capacity as cap
    from kvtax.harness.store import read_rows

    from pathlib import Path

    if not (Path(run_dir) / "rows.jsonl").is_file():
        raise OptionError(f"--from-run {run_dir} is not a run folder (no rows.jsonl)")
    per = cap.measured_bytes_per_token(read_rows(run_dir))
    if not per:
        raise OptionError(f"--from-run {run_dir} has no ok rows with cache bytes")
    print(f"measured resident KV bytes per token in {run_dir} (largest context per arm)")
    for arm, b in sorted(per.items()):
        line = f"  {arm:<18}{b:>12,.1f} B/token"
        if reserve:
            line += f"{int(reserve // b):>16,} tokens in {cap.format_size(reserve)}"
        print(line)
    return 0
