"""`kvtax roofline`: streaming bandwidth, matmul rate, and each attention path's share of them.

Measures the device's achievable streaming read bandwidth (a large reduction and a large
copy; the higher is the ceiling) and matmul rate, then one decode-attention call per KV
format x path x context over a cache shaped like --model's layer. Each measurement is a
row of kind "roofline" in a new run folder (rows.jsonl, config.json, env.json):
bandwidth_fraction = achieved GB/s / streaming GB/s (bytes that must move: the cache's
codes + scales + q + out), compute_headroom = matmul TFLOP/s / achieved TFLOP/s.

Examples:
  kvtax roofline                                   # CPU (or CUDA when present), small shapes
  kvtax roofline --device cuda --contexts 4k,16k,64k,128k --kv fp16,int8,int4
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtax.cli.options import add_allow_long, add_threads
from kvtax.cli.validate import at_least, parse_contexts, size
from kvtax.errors import OptionError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "roofline",
        help="streaming bandwidth and each attention path's achieved fraction of it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--model", default="llama-3.1-8b",
                   help="model whose layer shape to use: built-in config, HF folder, .gguf "
                        "file or hub id (only its config is read; default llama-3.1-8b)")
    p.add_argument("--contexts", type=parse_contexts, default=None,
                   help="cache lengths, k = 1024 (default 4k,16k,64k,128k CUDA; 1k,4k,16k CPU)")
    add_allow_long(p)
    p.add_argument("--kv", default="fp16,int8,int4", help="formats (default fp16,int8,int4)")
    p.add_argument("--paths", default="fused,fp16,unfused,dequant",
                   help="attention paths (default fused,fp16,unfused,dequant)")
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) or float32 (CPU)")
    p.add_argument("--iters", type=at_least(1), default=20, help="timed calls per measurement (20)")
    p.add_argument("--stream-bytes", type=size, default=None,
                   help="buffer for the bandwidth test (default 2GiB CUDA, 256MiB CPU)")
    add_threads(p)
    p.add_argument("--out", default="runs", help="parent folder of run folders (default runs)")
    p.add_argument("--name", default="roofline", help="run folder suffix (default roofline)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Stream and matmul peaks, then each arm's attention against them; one row a point."""
    from kvtax.cli.outcome import report_outcome
    from kvtax.cli.validate import check_contexts, check_formats, check_model, set_threads
    from kvtax.harness.analysis import roofline as rf
    from kvtax.harness.bench.plan import model_shape, resolve_kv
    from kvtax.harness.schema import PATHS
    from kvtax.harness.store import RunStore, environment

    dev_name, device, dtype = _device_dtype(args)
    set_threads(args.threads)
    cuda = device.type == "cuda"
    contexts = args.contexts or parse_contexts("4k,16k,64k,128k" if cuda else "1k,4k,16k")
    names = [k.strip() for k in args.kv.split(",") if k.strip()]
    check_formats(names, hybrid=True)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise OptionError(f"--paths {args.paths}: choose from {', '.join(PATHS)}")
    model_cfg = check_model(args.model)
    check_contexts(contexts, model_cfg, args.allow_long_context)
    shape = model_shape(args.model)
    assert shape is not None  # check_model found it
    kvs = [resolve_kv(k, shape[2]).name for k in names]
    config = {"kind": "roofline", "model": args.model, "device": dev_name, "dtype": str(dtype),
              "contexts": contexts, "kvs": kvs, "paths": paths, "iters": args.iters,
              "layer_shape": list(shape), "argv": sys.argv}
    store = RunStore.create(args.out, args.name, config)
    env = environment(dev_name)
    store.write_env(env)
    print(f"run folder {store.path}; device {env['device']}")
    emit = _Emitter(store, env, args.model)
    bw = rf.stream_bandwidth(device, args.stream_bytes, iters=args.iters)
    peak_gbs = max(bw["read"], bw["copy"])
    emit({"achieved_gbs": bw["read"], "peak_gbs": peak_gbs, "bytes_moved": int(bw["bytes"]),
          "bandwidth_fraction": bw["read"] / peak_gbs}, op="stream", variant="read")
    emit({"achieved_gbs": bw["copy"], "peak_gbs": peak_gbs, "bytes_moved": int(2 * bw["bytes"]),
          "bandwidth_fraction": bw["copy"] / peak_gbs}, op="stream", variant="copy")
    tflops = rf.matmul_rate(device, dtype)
    emit({"achieved_tflops": tflops, "peak_tflops": tflops}, op="matmul")
    print(f"streaming: read {bw['read']:.1f} GB/s, copy {bw['copy']:.1f} GB/s; "
          f"matmul {tflops:.2f} TFLOP/s ({dtype})")
    w = max(16, *(len(f"{kv}/{path}") + 1 for kv in kvs for path in paths))
    print(f"{'arm':<{w}}{'context':>9}{'time us':>11}{'GB/s':>9}{'of peak':>9}{'headroom':>10}")
    for ctx in contexts:
        for kv in kvs:
            for path in paths:
                if _applies(kv, path):
                    _attention_point(emit, kv, path, ctx, shape, device, dtype, args.iters,
                                     (peak_gbs, tflops), w)
    print(f"rows: {store.rows_path}")
    return report_outcome(store.rows(), "kvtax roofline", "points")


def _device_dtype(args: argparse.Namespace) -> tuple[str, Any, Any]:
    """(--device as given or chosen, torch.device, torch dtype); OptionError when unusable."""
    import torch

    from kvtax.harness.dtypes import torch_dtype

    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(dev_name)
    except RuntimeError as exc:
        raise OptionError(f"--device {dev_name}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError("--device cuda but torch sees no CUDA device")
    try:
        dtype = torch_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    except ValueError as exc:
        raise OptionError(f"--dtype: {exc}") from None
    return dev_name, device, dtype


def _applies(kv: str, path: str) -> bool:
    """False for arms that do not exist (fp16 path of a quantized format, a baseline of an
    unquantized one, a baseline of a hybrid spec: only kvtax's attention reads its parts)
    or that this command does not time (hf-quantized)."""
    if "@" in kv:
        return path == "fused"
    if path == "fp16":
        return kv == "fp16"
    if path in ("unfused", "dequant"):
        return kv not in ("fp16", "bf16", "fp32")
    return path != "hf-quantized"


class _Emitter:
    """Writes one roofline row per call: `emit(fields, op=..., kv=..., path=..., context=...)`."""

    def __init__(self, store: Any, env: dict[str, Any], model: str) -> None:
        self.store, self.env, self.model, self.seq = store, env, model, 0

    def __call__(self, fields: dict[str, Any], **ident: Any) -> dict[str, Any]:
        from kvtax.harness.schema import make_cell_id, utc_now

        kv, path = ident.get("kv", "-"), ident.get("path", "-")
        row = {
            "schema": 1, "run_id": self.store.run_id, "kind": "roofline", "seq": self.seq,
            "order_seed": 0, "rep": 0, "warmup": False, "model": self.model,
            "arm": f"{kv}/{path}" if path != "-" else ident.get("op", "-"), "kv": kv,
            "path": path if path != "-" else "fused", "context": ident.get("context", 0),
            "chunk_size": None, "decode_tokens": None, "status": "ok", "phase": None,
            "error": None, "timestamp": utc_now(), "device": self.env["device"],
            "git_commit": self.env.get("git_commit"), "op": ident["op"], "time_s": None,
            "bytes_moved": None, "flops": None, "achieved_gbs": None, "achieved_tflops": None,
            "peak_gbs": None, "peak_tflops": None, "bandwidth_fraction": None,
            "compute_headroom": None,
        }
        row["cell_id"] = make_cell_id({**ident, "kind": "roofline", "model": self.model})
        row.update(fields)
        self.store.append(row)
        self.seq += 1
        return row


def _attention_point(emit: _Emitter, kv: str, path: str, ctx: int, shape: Any, device: Any,
                     dtype: Any, iters: int, peaks: tuple[float, float],
                     width: int = 16) -> None:
    """Time one arm's decode attention at `ctx` tokens; its row, against the peaks (GB/s,
    TFLOP/s), and a table line. A failure is a row too: one point must not end the sweep."""
    import torch

    from kvtax.harness.analysis import roofline as rf
    from kvtax.harness.bench.worker import is_oom

    ident = {"op": "attention", "kv": kv, "path": path, "context": ctx}
    try:
        m = rf.attention_roofline(kv, path, ctx, shape, device, dtype, iters)
    except Exception as exc:  # noqa: BLE001 - the row says what failed
        status = "oom" if is_oom(exc) else "error"
        emit({"status": status, "phase": "attention", "error": repr(exc)[:500]}, **ident)
        print(f"{kv + '/' + path:<{width}}{ctx:>9}  {status}: {exc!r:.80}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return
    peak_gbs, tflops = peaks
    m.update(peak_gbs=peak_gbs, peak_tflops=tflops,
             bandwidth_fraction=m["achieved_gbs"] / peak_gbs,
             compute_headroom=tflops / m["achieved_tflops"])
    emit(m, **ident)
    print(f"{kv + '/' + path:<{width}}{ctx:>9}{m['time_s'] * 1e6:>11.1f}"
          f"{m['achieved_gbs']:>9.1f}{m['bandwidth_fraction']:>8.0%}"
          f"{m['compute_headroom']:>9.0f}x")
