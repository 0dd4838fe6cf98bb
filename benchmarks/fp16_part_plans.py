"""q4 decode under alternative launch plans for its fp16 part (sinks + recent window).

One Llama-3.1-8B layer (32 q heads, 8 KV heads, D 128, batch 1, fp16 or bf16), one decode row,
q4's hybrid cache at each context; each plan sets the fp16 part's decode_warp launch
(pipeline stages, slots per tile, splits per head) and how many splits the body gives
up, in place of `parts_plan.short_splits` / `make_room`. Every plan's output is checked
against the shipped plan's; times as attention.py's (CUDA-graph replays, L2 evicted by a
256 MiB read before each, median of --reps), with plain int4 and q4's body alone beside.

    python benchmarks/fp16_part_plans.py --contexts 32768 131072 --out runs/fp16-part
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import triton

from kvtax.attention import attention, parts_plan
from kvtax.attention import triton_api as ta
from kvtax.attention.triton_api import triton_attention
from kvtax.cache import FullCache
from kvtax.cache.hybrid import HybridCache
from kvtax.harness.bench.gpu_timer import Timer, git_commit

sys.path.insert(0, str(Path(__file__).parent))
from attention import BlockKeysCache  # noqa: E402  (benchmarks/, this script's folder)

# name: (stages, block_n, splits per head, body splits given up); None = as shipped
# (`parts_plan.short_splits` / `make_room`; the two parts in one launch, `parts_plan.folds`);
# "unfolded": as shipped, but the fp16 part in its own launch and the body beside it
# (stages and block_n apply there only: the folded part reads 16-position steps).
PLANS = {"shipped": None, "unfolded": "unfolded",
         **{f"s3n32x{n}g{g}": (3, 32, n, g) for n in (1, 2, 3, 5) for g in range(5)},
         "s1n16x1g1": (1, 16, 1, 1), "s1n32x1g1": (1, 32, 1, 1), "s2n32x1g1": (2, 32, 1, 1),
         "s1n16x2g2": (1, 16, 2, 2), "s1n32x2g2": (1, 32, 2, 2), "s1n16x3g3": (1, 16, 3, 3),
         "shipped-again": None, "unfolded-again": "unfolded"}

_shipped = (parts_plan.short_splits, parts_plan.make_room)
_FOLD = parts_plan.FOLD  # as the environment left it (KVTAX_FOLD)
DTYPE = "float16"  # --dtype


def use_plan(plan) -> None:
    """Point launch_parts_decode's plan functions at `plan` (None: restore the shipped)."""
    parts_plan.FOLD = _FOLD and plan != "unfolded"
    if plan is None or plan == "unfolded":
        parts_plan.short_splits, parts_plan.make_room = _shipped
        return
    stages, block_n, splits, give = plan

    def short(checked):
        small = checked[0]
        assert not small.view.spec.key.is_quantized, "q4's fp16 part launches first"
        small.cfg = dataclasses.replace(small.cfg, num_stages=stages, block_n=block_n,
                                        num_splits=splits)

    def room(checked):
        body = checked[-1]
        body.cfg = dataclasses.replace(body.cfg, num_splits=max(1, body.cfg.num_splits - give))
        return checked

    parts_plan.short_splits, parts_plan.make_room = short, room


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768, 65536, 131072])
    p.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--give", type=int, nargs="*", default=[],
                   help="also time plain int4 and q4's body with this many fewer splits")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                   help="the layer's queries and K / V (q4's fp16 part stays fp16)")
    p.add_argument("--out", default="runs/fp16-part")
    return p.parse_args()


def context_cells(ctx: int, give: list[int], plans: list[str]):
    """(q4's view, q, [(name, fn or plan name)]) for one context: a Llama-3.1-8B layer's
    random K/V in q4, plain int4 and q4's body alone (each also with `give` fewer splits)."""
    b, hq, hkv, d = 1, 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(ctx)
    dtype = getattr(torch, DTYPE)
    k, v = (torch.randn(b, hkv, ctx, d, generator=gen, device="cuda", dtype=dtype)
            for _ in range(2))
    q = torch.randn(b, hq, 1, d, generator=gen, device="cuda", dtype=dtype)
    q4 = HybridCache("q4", capacity=ctx, max_chunk=min(2048, ctx))
    for t0 in range(0, ctx, 2048):
        q4.append(k[:, :, t0:t0 + 2048], v[:, :, t0:t0 + 2048])
    int4 = FullCache("int4", capacity=ctx)
    int4.append(k, v)
    body = BlockKeysCache("k4w-c64v4", k, v)
    lengths = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    cells = [("int4", lambda: triton_attention(q, int4.view(), lengths=lengths)),
             ("body", lambda: triton_attention(q, body.view(), lengths=lengths))]
    for fmt, cache in (("int4", int4), ("body", body)):
        base = ta.launch_config(q, cache.view(), lengths)
        for n in give:
            cfg = dataclasses.replace(base, num_splits=max(1, base.num_splits - n))
            cells.append((f"{fmt}-{n}", lambda c=cache, f=cfg: triton_attention(
                q, c.view(), lengths=lengths, config=f)))
    return q4.view(), q, cells + [(name, name) for name in plans]


def main() -> None:
    global DTYPE
    args = parse_args()
    DTYPE = args.dtype
    if not torch.cuda.is_available():
        sys.exit("fp16_part_plans.py: needs a CUDA GPU (it times the fused decode kernels)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timer = Timer(args.reps, False, "read")
    print(json.dumps(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                          triton=triton.__version__, git=git_commit(), argv=sys.argv,
                          dtype=args.dtype)),
          flush=True)
    rows = []
    with open(out / "rows.jsonl", "a") as log:
        for ctx in args.contexts:
            view, q, cells = context_cells(ctx, args.give, args.plans)
            use_plan(None)
            expect = attention(q, view).float()
            for name, fn in cells:
                err = float("nan")
                if isinstance(fn, str):  # a plan: q4 under it, checked against the shipped
                    use_plan(PLANS[fn])
                    got = attention(q, view).float()
                    err = ((got - expect).norm() / expect.norm()).item()
                    fn = lambda: attention(q, view)  # noqa: E731
                ms, p20, p80 = timer(fn)
                use_plan(None)
                row = dict(ctx=ctx, plan=name, ms=ms, p20=p20, p80=p80, err_vs_shipped=err)
                rows.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(f"{ctx:>7} {name:<14} {ms:.4f} ({p20:.4f}-{p80:.4f})  err {err:.1e}",
                      flush=True)
            del view, q, cells
            torch.cuda.empty_cache()
    print_table(rows, args)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    """Markdown: each cell's ms and its ratio to plain int4's at that context."""
    base = {r["ctx"]: r["ms"] for r in rows if r["plan"] == "int4"}
    print("\n| plan | " + " | ".join(str(c) for c in args.contexts) + " |")
    names = ["body", *[f"{f}-{g}" for f in ("int4", "body") for g in args.give], *args.plans]
    for name in names:
        cells = [f"{r['ms']:.4f} ({r['ms'] / base[r['ctx']]:.3f})" for r in rows
                 if r["plan"] == name]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
