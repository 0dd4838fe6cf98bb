"""Attention over a quantized KV cache on one GPU: kvtax's fused kernels vs the baselines.

Arms: kvtax fused kernels (fp16, int8, int4, fp8 caches; `kvtax-k4wc64v4`: q4's body,
K int4w-c64 (a fifth bit on the widest 3/8 channels of the sequence's first block) and V
int4 (g64) in one plain view, no fp16 parts, decoded by the Gluon swap kernel;
`kvtax-k4c64v4`: the same without the fifth bit (int4-c64 keys, q4's body until
2026-12-05); `kvtax-int4c64`: int4-c64 keys beside int4-g32 values; `kvtax-k3c64v3`:
q3's body, K int3-c64 and V int3-g32, on the tile kernels; `kvtax-q4` / `kvtax-q3` /
`kvtax-q4k`: the whole q4 / q3 / k4-c64v4@s4r128 spec, fp16 sinks and recent ring, body
and LSE merge, as a model layer calls it); torch SDPA fp16 (flash and
cuDNN backends); Hugging Face's approach (dequantize the whole int8/int4 cache, then
SDPA); mlx-lm's approach (materialize [H, L, ctx] scores). The baselines are
kvtax.attention.baselines' functions, the ones `kvtax bench` measures. Llama-3.1-8B
layer shapes by default, contexts as arguments, decode (1 row) and a prefill chunk at
the end.

Every call is captured in a CUDA graph and replayed; a 256 MiB read evicts L2 before
each replay (clean lines, as inside a model's decode step, whose kernels before attention
write a few KiB; a write flush leaves L2 full of dirty lines for the timed call to write
back, 4-10 us per decode call on an H200: `--flush write`); the median of --reps replays
is reported with p20/p80, plus TB/s (cache bytes read / time) against a streaming-read
ceiling measured in the same run, TFLOP/s, and transient memory (peak allocation during
one eager call).

    python benchmarks/attention.py --out runs/attention
    python benchmarks/attention.py --contexts 4096 131072 --phases decode --arms kvtax-int4 sdpa-cudnn
    python benchmarks/attention.py --dry-run        # CPU, tiny shapes, checks the script
    python benchmarks/attention.py --introspect     # + what each kvtax decode cell ran with

Writes rows.jsonl, rows.csv, config.json and summary.md under --out/<timestamp>/; prints
the markdown summary last.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from introspect import record as introspect_record  # noqa: E402  (benchmarks/, as report)
from report import markdown_summary  # noqa: E402  (benchmarks/, the script's folder)

from kvtax.attention.baselines import (  # noqa: E402
    attention_dequant, attention_sdpa, attention_unfused,
)
from kvtax.attention.checks import rotate_query, unrotate_output  # noqa: E402
from kvtax.attention.triton_api import LaunchConfig, triton_attention  # noqa: E402
from kvtax.attention.view import CacheView  # noqa: E402
from kvtax.attention import attention  # noqa: E402
from kvtax.cache import FullCache  # noqa: E402
from kvtax.cache.hybrid import HybridCache  # noqa: E402
from kvtax.formats import ChannelBlockFormat, KVSpec  # noqa: E402
from kvtax.harness.bench.gpu_timer import WARMUP_MS, Timer, stats  # noqa: E402
from kvtax.harness.bench.step_profile import attention_critical_us, critical_path  # noqa: E402
from kvtax.harness.bench.gpu_timer import git_commit as _git_commit  # noqa: E402

KVTAX = {"kvtax-fp16": "fp16", "kvtax-int8": "int8", "kvtax-int4": "int4", "kvtax-fp8": "fp8",
         "kvtax-int8hk": "int8+hk", "kvtax-int4c64": "k4-c64v4-g32", "kvtax-k4c64v4": "k4-c64v4",
         "kvtax-k3c64v3": "k3-c64v3-g32", "kvtax-k4wc64v4": "k4w-c64v4"}
# Hybrid arms: the whole spec a user names (fp16 sinks + recent ring, quantized body, LSE
# merge), through kvtax.attention.attention as a model layer calls it.
HYBRID = {"kvtax-q4": "q4", "kvtax-q3": "q3", "kvtax-q4k": "k4-c64v4@s4r128"}
ALL_ARMS = [
    *KVTAX, *HYBRID, "sdpa-flash", "sdpa-cudnn", "hf-dequant-sdpa-int8", "hf-dequant-sdpa-int4",
    "unfused-int8", "unfused-int4",
]
# alternatives to the launch table, each an explicit LaunchConfig (`sweep_config`)
# decode: "tile" is decode.py's launch, "warp" warp_decode_config's defaults; the others
# vary its keyword arguments (tile sizes, pipeline stages, programs per SM)
SWEEP_DECODE = {
    "tile": None, "warp": {}, "n16": dict(block_n=16), "n64": dict(block_n=64),
    "s2": dict(num_stages=2), "s4": dict(num_stages=4), "s5": dict(num_stages=5),
    "sm4": dict(per_sm=4), "sm6": dict(per_sm=6), "sm10": dict(per_sm=10),
    "sm12": dict(per_sm=12), "sm16": dict(per_sm=16), "n64sm4": dict(block_n=64, per_sm=4),
}
# kernel "swap" (int8 / int4, G * L <= 4): swap_decode_config's keyword arguments
SWEEP_SWAP = {"swap": {}, "swap-s3": dict(num_stages=3), "swap-sm6": dict(per_sm=6),
              "swap-sm8": dict(per_sm=8), "swap-sm12": dict(per_sm=12)}
SWEEP_PREFILL = {"n64": dict(block_n=64), "n128": dict(block_n=128), "s4": dict(num_stages=4),
                 "s2": dict(num_stages=2), "n64s4": dict(block_n=64, num_stages=4),
                 "m64w4": dict(block_m=64, num_warps=4),
                 "m64w4s2": dict(block_m=64, num_warps=4, num_stages=2),
                 "m64w4s4": dict(block_m=64, num_warps=4, num_stages=4),
                 "m64w4n64": dict(block_m=64, num_warps=4, block_n=64),
                 "m128w4": dict(num_warps=4)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536, 131072],
                   help="cache lengths in tokens (default: 4k 16k 64k 128k)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk rows (default 2048)")
    p.add_argument("--phases", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    p.add_argument("--arms", nargs="+", default=ALL_ARMS, choices=ALL_ARMS)
    p.add_argument("--reps", type=int, default=25, help="timed graph replays per cell (>= 20)")
    p.add_argument("--warmup-ms", type=float, default=WARMUP_MS,
                   help=f"graph replays for this long before each cell's timed ones (default "
                        f"{WARMUP_MS:g}; 0: none, as before 2026-12-02)")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                   help="the model dtype: queries and K/V before quantization; with bfloat16 "
                        "the float arms (kvtax-fp16, SDPA) hold bf16 K/V (default float16)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--sweep", action="store_true",
                   help="also time alternative kvtax launch configs (decode at the largest "
                        "context, prefill at --sweep-prefill-ctx)")
    p.add_argument("--sweep-prefill-ctx", type=int, default=16384)
    p.add_argument("--sweep-formats", nargs="+", default=["fp16", "int8", "int4", "fp8"],
                   help="arms' names after kvtax- (kernel \"swap\" variants for int8, int4, "
                        "k4c64v4, k4wc64v4)")
    p.add_argument("--sweep-variants", nargs="+", default=None,
                   help="names from SWEEP_DECODE, SWEEP_SWAP, SWEEP_PREFILL")
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="start no new cell after this many seconds (rows so far are kept)")
    p.add_argument("--flush", choices=["write", "read"], default="read",
                   help="evict L2 between replays by reading 256 MiB (clean lines: the "
                        "default since 2026-12-02) or by writing it (leaves L2 full of dirty "
                        "lines the timed call writes back: 4-10 us per decode call on an H200)")
    p.add_argument("--in-layer", choices=["layer", "store", "off"], default="layer",
                   help="also time each kvtax decode arm as a decoder layer runs it, "
                        "attention charged on the critical path as decode.py --profile "
                        "charges a model layer's: layer (default) between the qkv GEMV + "
                        "cache store before it and the o GEMV after it; store: after the "
                        "cache store only; off")
    p.add_argument("--kernel-times", action="store_true",
                   help="also record each kernel's mean device time (torch.profiler, eager "
                        "calls) per cell: split vs reduce, rotation, casts")
    p.add_argument("--introspect", action="store_true",
                   help="record beside each kvtax decode cell the Triton variants compiled so "
                        "far, where its tensors lie (address mod 2 MiB / 64 KiB, allocator "
                        "segment) and the clocks (benchmarks/introspect.py)")
    p.add_argument("--out", default="runs/attention", help="results go to OUT/<timestamp>/")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no graphs")
    return p.parse_args(argv)


def transient_bytes(fn, dry: bool) -> tuple[int, torch.Tensor]:
    """Peak bytes allocated above the baseline during one eager call (output included)."""
    if dry:
        return 0, fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def flops(hq: int, d: int, n_q: int, ctx: int) -> float:
    """QK^T and PV multiply-adds of causal bottom-right attention (2 FLOPs each)."""
    visible = n_q * ctx - n_q * (n_q - 1) / 2
    return 4.0 * hq * d * visible


def build_arm(name, q, caches, lengths, args):
    """(fn, cache bytes read, note) for one arm."""
    from torch.nn.attention import SDPBackend

    if name in HYBRID:
        cache = caches[HYBRID[name]]
        view = cache.view()
        return lambda: attention(q, view), cache.used_nbytes, cache.spec.name
    if name.startswith("kvtax-"):
        fmt, tag = KVTAX[name.split("@")[0]], name.partition("@")[2]
        view = caches[fmt].view()
        cfg = sweep_config(tag, q, view, lengths) if tag else None
        return kvtax_arm(q, view, lengths, cfg), caches[fmt].used_nbytes, tag
    if name.startswith("sdpa-"):
        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa-flash" else SDPBackend.CUDNN_ATTENTION
        view = caches["fp16"].view()
        fn = _under(backend, lambda: attention_sdpa(q, view, lower_right=True))
        return fn, caches["fp16"].used_nbytes, "enable_gqa"
    fmt = name.rsplit("-", 1)[1]
    view = caches[fmt].view()
    if name.startswith("hf-dequant"):
        fn = _under(SDPBackend.FLASH_ATTENTION,
                    lambda: attention_dequant(q, view, lower_right=True))
        return fn, caches[fmt].used_nbytes, "flash"
    need = unfused_bytes_estimate(q, view.length)
    if not args.dry_run and need > 0.8 * torch.cuda.mem_get_info()[0]:
        raise MemoryError(f"needs ~{need / 2**30:.0f} GiB of scores")
    return lambda: attention_unfused(q, view), caches[fmt].used_nbytes, "dequantized K/V"


def kvtax_arm(q, view, lengths, config=None):
    """Fused kernels reading the quantized cache (device lengths: the CUDA-graph mode).
    A Hadamard-rotated spec (`+hk`) rotates the query first, as `kvtax.attention` does,
    so the rotation's launch is part of the timed call."""
    if view.spec.rotate:
        return lambda: unrotate_output(
            triton_attention(rotate_query(q, view), view, lengths=lengths, config=config), view)
    return lambda: triton_attention(q, view, lengths=lengths, config=config)


def _under(backend, fn):
    """fn run with SDPA restricted to one backend (the arm fails where it cannot serve)."""
    from torch.nn.attention import sdpa_kernel

    def call():
        with sdpa_kernel([backend]):
            return fn()

    return call


def unfused_bytes_estimate(q, ctx: int) -> int:
    """Transient bytes of the unfused arm: scores, their masked copy and the
    probabilities, all in fp16 (2 + 2 + 2 bytes per score)."""
    b, hq, n_q, _ = q.shape
    return b * hq * n_q * ctx * 6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float32."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def sweep_config(tag, q, view, lengths) -> LaunchConfig:
    """The launch of one sweep variant (see SWEEP_DECODE / SWEEP_SWAP / SWEEP_PREFILL)."""
    import dataclasses

    from kvtax.attention import triton_api as ta

    base = ta.launch_config(q, view, lengths)
    if base.path == "decode":
        if tag == "tile":
            return ta.tile_decode_config(q, view, lengths)
        if tag in SWEEP_SWAP:
            reason = ta.swap_reason(q, view)
            if reason is not None:
                raise ValueError(f"{tag}: {reason}")
            return ta.swap_decode_config(q, view, lengths, **SWEEP_SWAP[tag])
        return ta.warp_decode_config(q, view, lengths, **SWEEP_DECODE[tag])
    return dataclasses.replace(base, **SWEEP_PREFILL[tag])


def cell_list(args):
    """(ctx, phase, arm) in run order; sweep cells after the main grid."""
    cells = [(c, ph, a) for c in args.contexts for ph in args.phases for a in args.arms]
    if args.sweep:
        keep = lambda t: args.sweep_variants is None or t in args.sweep_variants  # noqa: E731
        for fmt in args.sweep_formats:
            dec = [t for t in SWEEP_DECODE if keep(t)]
            if fmt in ("int8", "int4", "k4c64v4", "k4wc64v4"):  # kernel "swap" serves these
                dec += [t for t in SWEEP_SWAP if keep(t)]
            pre = [t for t in SWEEP_PREFILL if keep(t)]
            cells += [(max(args.contexts), "decode", f"kvtax-{fmt}@{t}") for t in dec]
            cells += [(args.sweep_prefill_ctx, "prefill", f"kvtax-{fmt}@{t}") for t in pre]
    return cells


def main(argv=None) -> None:
    args = parse_args(argv)
    dry = args.dry_run
    if dry:
        args.contexts, args.chunk, args.reps = [64, 96], 24, 3
        args.sweep_prefill_ctx = 96
        args.q_heads, args.kv_heads, args.head_dim = 8, 2, 64
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(
        command="python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        date=dt.datetime.now().isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(0) if not dry else "cpu (dry run)",
        torch=torch.__version__, triton=triton.__version__, git=_git_commit(), args=vars(args),
    )
    timer = Timer(args.reps, dry, args.flush, warmup_ms=args.warmup_ms)
    t0 = time.time()
    ceiling, ceiling_rows = (float("nan"), []) if dry else _ceiling(timer)
    config["read_ceiling_tbps"], config["read_ceiling_kernels"] = ceiling, ceiling_rows
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    print(f"device {config['device']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"read ceiling {ceiling:.2f} TB/s", flush=True)

    rows, cells = [], cell_list(args)
    jsonl = open(out_dir / "rows.jsonl", "a")
    main_cells = [c for c in cells if "@" not in c[2]]
    for group in (main_cells, [c for c in cells if "@" in c[2]]):  # the main grid first
        for ctx in sorted({c for c, _, _ in group}):
            if time.time() - t0 > args.budget_s:
                print(f"budget of {args.budget_s:.0f}s spent: skipping the rest", flush=True)
                break
            for row in run_context(ctx, [c for c in group if c[0] == ctx], timer, ceiling, args, t0):
                rows.append(row)
                jsonl.write(json.dumps(row) + "\n")
                jsonl.flush()
                print(_line(row), flush=True)
    jsonl.close()
    _write_csv(out_dir / "rows.csv", rows)
    summary = markdown_summary(rows, config)
    (out_dir / "summary.md").write_text(summary)
    print(f"\nresults in {out_dir}\n")
    print(summary)


def run_context(ctx, cells, timer, ceiling, args, t0):
    """Build one context's caches and queries, then yield a row per (phase, arm) cell."""
    dev = "cpu" if args.dry_run else "cuda"
    b, hq, hkv, d = args.batch, args.q_heads, args.kv_heads, args.head_dim
    gen = torch.Generator(device=dev).manual_seed(ctx)
    dtype = getattr(torch, args.dtype)
    kv = [torch.randn(b, hkv, ctx, d, generator=gen, device=dev, dtype=dtype)
          for _ in range(2)]
    caches = {}
    wanted = {"fp16", "int8", "int4", "fp8"} | {KVTAX[a.split("@")[0]] for _, _, a in cells
                                                if a.split("@")[0] in KVTAX}
    for name in {a for _, _, a in cells} & set(HYBRID):
        spec = HYBRID[name]
        step = min(args.chunk, ctx)  # its fp16 ring takes prefill chunks of <= step tokens
        caches[spec] = HybridCache(spec, capacity=ctx, max_chunk=step)
        for t0 in range(0, ctx, step):
            caches[spec].append(*(x[:, :, t0:t0 + step] for x in kv))
    for fmt in sorted(wanted):
        if isinstance(KVSpec.parse(fmt).key, ChannelBlockFormat):  # int4-c64, int3-c64
            caches[fmt] = BlockKeysCache(fmt, *kv)
            continue
        spec = "bf16" if fmt == "fp16" and dtype == torch.bfloat16 else fmt  # the float arms
        caches[fmt] = FullCache(spec, capacity=ctx)
        caches[fmt].append(*kv)
    lengths = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    last = tuple(x[:, :, -1:].clone() for x in kv)  # the newest token, for in_layer
    for phase in args.phases:
        arms_here = [a for c, ph, a in cells if ph == phase]
        if not arms_here:
            continue
        n_q = 1 if phase == "decode" else min(args.chunk, ctx)
        q = torch.randn(b, hq, n_q, d, generator=gen, device=dev, dtype=dtype)
        expect = triton_attention(q, caches["fp16"].view())
        for arm in arms_here:
            if time.time() - t0 > args.budget_s:
                return
            yield run_cell(arm, phase, ctx, q, caches, lengths, expect, timer, ceiling, args,
                           last)
    del kv, caches
    if not args.dry_run:
        torch.cuda.empty_cache()


class BlockKeysCache:
    """A plain view of `k`, `v` `[B, H_kv, ctx, D]` under a spec with int4-c64 or int3-c64
    keys, both quantized into block-aligned storage (slots rounded up to 64; the padding
    rows are zeros past the length). `used_nbytes` counts the format's bytes per token of
    the `ctx` tokens, as FullCache's does."""

    def __init__(self, spec: str, k: torch.Tensor, v: torch.Tensor) -> None:
        self.spec = KVSpec.parse(spec)
        b, h, ctx, d = k.shape
        pad = -ctx % self.spec.key.block
        k, v = (torch.cat([x, x.new_zeros(b, h, pad, d)], dim=2) for x in (k, v))
        self._view = CacheView(self.spec.key.quantize(k), self.spec.value.quantize(v),
                               self.spec, head_dim=d, length=ctx, dtype=k.dtype)
        self.used_nbytes = self.spec.bytes_per_token(d, k.dtype) * b * h * ctx

    def view(self) -> CacheView:
        return self._view


def run_cell(arm, phase, ctx, q, caches, lengths, expect, timer, ceiling, args, last) -> dict:
    b, hq, n_q, d = q.shape
    row = dict(arm=arm, phase=phase, ctx=ctx, rows=n_q, batch=b, q_heads=hq,
               kv_heads=args.kv_heads, head_dim=d, status="ok", note="")
    try:
        fn, nbytes, note = build_arm(arm, q, caches, lengths, args)
        row["note"] = note or ""
        mem, out = transient_bytes(fn, args.dry_run)
        row["rel_err_vs_fp16"] = rel_err(out, expect)
        del out
        ms, p20, p80 = timer(fn)
        if phase == "decode" and args.in_layer != "off" and not args.dry_run:
            try:  # an extra reading: its failure must not cost the cell its timing
                row.update(in_layer(arm, fn, caches, last, ctx, timer, args.in_layer))
            except Exception as exc:  # noqa: BLE001
                row["in_layer_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        if args.kernel_times and not args.dry_run:
            row["kernel_us"] = kernel_times(fn)
        if args.introspect and phase == "decode" and arm.split("@")[0] in KVTAX:
            fmt = KVTAX[arm.split("@")[0]]
            row["introspect"] = introspect_record(caches[fmt].view(), q, {"lengths": lengths})
        moved = nbytes + 2 * q.numel() * q.element_size()
        row.update(median_ms=ms, p20_ms=p20, p80_ms=p80, bytes=moved, flops=flops(hq, d, n_q, ctx),
                   transient_mib=mem / 2**20)
        row["tbps"] = moved / (ms * 1e-3) / 1e12
        row["frac_ceiling"] = row["tbps"] / ceiling if ceiling == ceiling else None
        row["tflops"] = row["flops"] / (ms * 1e-3) / 1e12
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
        row.update(status="oom", note=str(exc).splitlines()[0][:120])
    except Exception as exc:  # noqa: BLE001  (one arm's failure must not end the run)
        row.update(status="error", note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    if not args.dry_run:
        torch.cuda.empty_cache()
    return row


def in_layer(arm, fn, caches, last, ctx, timer, mode) -> dict:
    """A kvtax decode arm as a decoder layer's decode step runs it. mode "layer": the
    attention half of a Llama-3.1-8B layer around it, kvtax's fused GEMVs as the model
    launches them: RMSNorm + qkv projection + RoPE, the cache store of the step's token (the
    newest token written again at position ctx - 1: the cache is unchanged), attention, the
    o projection + residual. Under PDL the store and the attention kernels launch early and
    overlap what runs before them, and the o GEMV's first weight tile overlaps them, as in
    the model (the GEMVs' outputs are not attention's inputs here; only their timing
    matters). mode "store": the store and attention only. Attention (split + reduce) is
    charged on the critical path (kvtax.harness.bench.step_profile), as `decode.py
    --profile` charges each layer's. {} for arms whose cache has no device-side store."""
    from kvtax.models.gemv import gemv
    from kvtax.models.rope import inv_frequencies

    cache = caches.get(KVTAX.get(arm))
    if not isinstance(cache, FullCache) or cache.device_write_blocker() is not None:
        return {}
    k, v = last
    dev, dt = k.device, k.dtype
    pos = torch.full((1,), ctx - 1, dtype=torch.int64, device=dev)
    out = fn()  # [B, H_q, 1, D]
    b, hq, d, hkv = k.shape[0], out.shape[1], out.shape[-1], k.shape[1]
    width, n_qkv = hq * d, (hq + 2 * hkv) * d
    gen = torch.Generator(device=dev).manual_seed(ctx)
    w = {n: torch.randn(rows, width, generator=gen, device=dev, dtype=dt) / width**0.5
         for n, rows in (("qkv", n_qkv), ("o", width))}
    x = torch.randn(b, width, generator=gen, device=dev, dtype=dt)
    norm = torch.ones(width, device=dev, dtype=dt)
    rope = (pos, inv_frequencies(d, 500000.0, None).to(dev), (hq + hkv) * d)

    def step():
        if mode == "layer":
            gemv(x, w["qkv"], norm_weight=norm, rope=rope)
        cache.write_at(k, v, pos)
        out = fn()
        if mode == "layer":
            gemv(out.reshape(b, width), w["o"], residual=x)
        return out

    runs = timer.replay_spans(step)
    ms, p20, p80 = (t / 1e3 for t in stats(attention_critical_us(runs)))
    roles = [critical_path(run, 1, 1) for run in runs]  # its GEMVs are named qkv, o
    spans: dict[str, list[float]] = {}
    for run in runs:
        for name, start, end in run:
            spans.setdefault(name[:48], []).append(end - start)
    return dict(in_layer=mode, in_layer_ms=ms, in_layer_p20_ms=p20, in_layer_p80_ms=p80,
                in_layer_us_by_role={r: round(stats([ro.get(r, 0.0) for ro in roles])[0], 2)
                                     for r in sorted({r for ro in roles for r in ro})},
                in_layer_kernel_us={n: round(stats(v)[0], 2) for n, v in spans.items()})


def kernel_times(fn, calls: int = 10) -> dict[str, float]:
    """Mean device µs per call of each kernel `fn` launches (eager calls, profiled)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            name = ev.name[:60]
            times[name] = times.get(name, 0.0) + ev.device_time / calls
    return {k: round(v, 2) for k, v in sorted(times.items(), key=lambda kv: -kv[1])}


def _ceiling(timer):
    from kvtax.harness.bench.read_ceiling import read_ceiling

    return read_ceiling(timer)


def _line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['phase']:7s} ctx {r['ctx']:6d} {r['arm']:28s} {r['status']}: {r['note']}"
    return (f"{r['phase']:7s} ctx {r['ctx']:6d} {r['arm']:28s} {r['median_ms']:8.3f} ms "
            f"{r['tbps']:6.2f} TB/s {r['tflops']:7.1f} TFLOP/s {r['transient_mib']:9.1f} MiB "
            f"err {r['rel_err_vs_fp16']:.1e} {r['note']}")


def _write_csv(path: Path, rows: list[dict]) -> None:
    keys = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
