"""How fast one kernel can read N bytes, alone and in a chain: the decode step's floor per kernel.

decode.py compares a decode step with (weight + KV bytes) / read ceiling, the ceiling
measured over a 2 GiB read. A decode step is instead ~240 kernels of 7-230 µs each, and
every kernel pays its launch, its first loads' latency and its tail. This script
measures what that costs a plain streaming read (readceiling.py's kernel, best of three
launch shapes) at the byte counts of a Llama-3.1-8B decode step:

  single  one read of each projection's size, alone (CUDA graph, L2 flushed, median)
  chain   the 32 layers' four reads back to back in one graph (distinct buffers laid out
          like the weights), against one kernel reading the same bytes: the difference
          divided by the kernel count is the cost of a kernel boundary
  pdl     the chain again with programmatic dependent launch: each read waits for the one
          before (`griddepcontrol.wait`) at its start or after its first block (a GEMV's
          weight loads need nothing from the kernel before), and lets the next one launch
          (`launch_dependents`) first thing, after its loop, or only at exit; "nowait" is
          the bound (no ordering at all)

    python benchmarks/kernel_floor.py --out results/floor.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvtax.harness.bench.gpu_timer import Timer, git_commit
from kvtax.harness.bench.read_ceiling import stream_read_kernel

# Llama-3.1-8B bf16 weight bytes per decode step, in launch order within a layer
LLAMA8B = {"qkv": 6144 * 4096 * 2, "o": 4096 * 4096 * 2, "gate_up": 28672 * 4096 * 2,
           "down": 4096 * 14336 * 2, "lm_head": 128256 * 4096 * 2}
SHAPES = ((4096, 8, 4), (8192, 8, 8), (2048, 4, 16))  # (BLOCK, num_warps, programs per SM)


@triton.jit
def _read_pdl_kernel(X, Out, n, BLOCK: tl.constexpr, WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    """stream_read_kernel under PDL. WAIT: 0 never, 1 first thing, 2 after the first
    block's load; TRIGGER: 0 at exit only, 1 first thing, 2 after the loop."""
    if TRIGGER == 1:
        gdc_launch_dependents()
    if WAIT == 1:
        gdc_wait()
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.load(X + pid * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    if WAIT == 2:
        gdc_wait()
    for start in range(pid * BLOCK + step, n, step):
        acc += tl.load(X + start + tl.arange(0, BLOCK)).to(tl.float32)
    if TRIGGER == 2:
        gdc_launch_dependents()
    tl.store(Out + pid, tl.sum(acc, 0))


PDL_VARIANTS = {"nowait-start": (0, 1), "wait-start/start": (1, 1), "wait-start/loop": (1, 2),
                "wait-start/exit": (1, 0), "wait-first/start": (2, 1),
                "wait-first/loop": (2, 2), "wait-first/exit": (2, 0)}  # name → (WAIT, TRIGGER)


def pdl_reader(x: torch.Tensor, block: int, warps: int, per_sm: int, wait: int,  # noqa: ANN201
               trigger: int):
    """As `reader`, launched with programmatic dependent launch."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = min(sms * per_sm, x.numel() // block)
    part = torch.empty(grid, device=x.device, dtype=torch.float32)
    return lambda: _read_pdl_kernel[(grid,)](x, part, x.numel(), BLOCK=block, WAIT=wait,
                                             TRIGGER=trigger, num_warps=warps, launch_pdl=True)


def reader(x: torch.Tensor, block: int, warps: int, per_sm: int):  # noqa: ANN201
    """A launch reading fp16 `x` once (its length a multiple of block), as a closure."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = min(sms * per_sm, x.numel() // block)
    part = torch.empty(grid, device=x.device, dtype=torch.float32)
    return lambda: stream_read_kernel[(grid,)](x, part, x.numel(), BLOCK=block,
                                                num_warps=warps)


def best(timer: Timer, x: torch.Tensor) -> dict:
    """The fastest launch shape reading x: µs, TB/s, the shape."""
    rows = []
    for block, warps, per_sm in SHAPES:
        ms, p20, p80 = timer(reader(x, block, warps, per_sm))
        rows.append(dict(us=1000 * ms, p20_us=1000 * p20, p80_us=1000 * p80,
                         shape=f"b{block}-w{warps}-sm{per_sm}"))
    top = min(rows, key=lambda r: r["us"])
    return {**top, "bytes": x.numel() * 2, "TBps": x.numel() * 2 / top["us"] / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32, help="layers in the chain (default 32)")
    p.add_argument("--reps", type=int, default=20, help="timed replays per case (default 20)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_floor.py measures a GPU: no CUDA device here")
    timer = Timer(reps=args.reps, dry=False, flush="read")
    per_layer = [LLAMA8B[k] for k in ("qkv", "o", "gate_up", "down")]
    total = args.layers * sum(per_layer)
    buf = torch.randn(total // 2, device="cuda", dtype=torch.float16)
    single = {}
    for name, nbytes in LLAMA8B.items():
        x = buf[: nbytes // 2] if nbytes <= total else torch.randn(
            nbytes // 2, device="cuda", dtype=torch.float16)
        single[name] = best(timer, x)
        r = single[name]
        print(f"single {name:8} {nbytes / 2**20:8.1f} MiB {r['us']:8.2f} us "
              f"{r['TBps']:.3f} TB/s ({r['shape']})", file=sys.stderr)
    # the chain: each layer's four reads from consecutive slices, one launch shape each
    views, off = [], 0
    for _ in range(args.layers):
        for nbytes in per_layer:
            views.append(buf[off: off + nbytes // 2])
            off += nbytes // 2
    shape = {n: SHAPES[[f"b{b}-w{w}-sm{s}" for b, w, s in SHAPES].index(single[n]["shape"])]
             for n in ("qkv", "o", "gate_up", "down")}
    launches = [reader(v, *shape[n]) for v, n in zip(views, ["qkv", "o", "gate_up", "down"]
                                                       * args.layers)]
    ms, p20, p80 = timer(lambda: [f() for f in launches])
    one = best(timer, buf)
    chain = dict(kernels=len(launches), bytes=total, us=1000 * ms, p20_us=1000 * p20,
                 p80_us=1000 * p80, TBps=total / (1000 * ms) / 1e6, one_kernel=one,
                 boundary_us=(1000 * ms - one["us"]) / len(launches))
    print(f"chain  {len(launches)} kernels {total / 2**30:.2f} GiB {chain['us']:.1f} us "
          f"({chain['TBps']:.3f} TB/s); one kernel {one['us']:.1f} us ({one['TBps']:.3f}); "
          f"{chain['boundary_us']:.2f} us per kernel boundary", file=sys.stderr)
    pdl = {}
    names = ["qkv", "o", "gate_up", "down"] * args.layers
    for tag, (wait, trigger) in PDL_VARIANTS.items():
        fns = [pdl_reader(v, *shape[n], wait, trigger) for v, n in zip(views, names)]
        ms, p20, p80 = timer(lambda fns=fns: [f() for f in fns])
        pdl[tag] = dict(us=1000 * ms, p20_us=1000 * p20, p80_us=1000 * p80,
                        boundary_us=(1000 * ms - one["us"]) / len(fns))
        print(f"pdl {tag:18} {1000 * ms:8.1f} us, {pdl[tag]['boundary_us']:.2f} us per "
              f"boundary", file=sys.stderr)
    chain["pdl"] = pdl
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(
            meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                      git_commit=git_commit(), command=" ".join(sys.argv)),
            single=single, chain=chain), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
