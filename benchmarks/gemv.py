"""Decode linear layers on one GPU: kvtax's fused Triton GEMV vs cuBLAS and compiled torch.

Shapes are Llama-3.1-8B's at batch 1 (bf16), each with the neighbours the decoder fuses:
qkv (RMSNorm before), o (residual add after), gate/up (RMSNorm before, SiLU(gate)·up
after), down (residual add after), lm_head (final RMSNorm before). Arms, side by side:

    cublas          F.linear alone (no neighbours): the GEMV the profile shows today
    kvtax-plain     kvtax gemv alone (no neighbours): the same work as cublas
    torch-unfused   the model's sequence (F.rms_norm, F.linear, silu·mul, add) compiled
                    with torch.compile (several kernels)
    kvtax           kvtax gemv with the neighbours fused, default config
    kvtax@<tag>     --sweep: the fused gemv under other GemvConfigs (tag = config)

Each call is captured in a CUDA graph and replayed; a 256 MiB write flushes L2 before
each replay; median of --reps replays with p20/p80 (kvtax.harness.bench.gpu_timer, as for
attention.py). Per cell: µs, TB/s of the bytes the fused layer must move (weights + x + output [+ residual, norm weight]) and the
fraction of a streaming-read ceiling measured in the same run
(kvtax.harness.bench.read_ceiling), and the
max abs error against gemv_reference (float32), checked before timing.

    python benchmarks/gemv.py --out runs/gemv
    python benchmarks/gemv.py --shapes o down --sweep
    python benchmarks/gemv.py --dry-run        # CPU, Triton interpreter, tiny shapes, no graphs

Writes rows.jsonl, config.json and summary.md under --out/<timestamp>/ and prints the
markdown table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from kvtax.harness.bench.gpu_timer import Timer, git_commit as _git_commit  # noqa: E402

from kvtax.models.gemv import NUM_WARPS, GemvConfig, default_config, gemv, gemv_reference  # noqa: E402

# name: (N rows of W, K, fusion); gate_up's W holds gate and up (2 x 14336 rows)
SHAPES = {
    "qkv": (6144, 4096, "norm"),
    "o": (4096, 4096, "residual"),
    "gate_up": (28672, 4096, "norm+silu"),
    "down": (4096, 14336, "residual"),
    "lm_head": (128256, 4096, "norm"),
}
DRY_SHAPES = {"qkv": (48, 64, "norm"), "o": (32, 64, "residual"),
              "gate_up": (64, 64, "norm+silu"), "down": (32, 96, "residual"),
              "lm_head": (80, 64, "norm")}
PER_TOKEN = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}  # Llama-3.1-8B
ARMS = ["cublas", "kvtax-plain", "torch-unfused", "kvtax"]
EPS = 1e-5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    p.add_argument("--rows", type=int, default=1, help="decode batch M (1..4; default 1)")
    p.add_argument("--reps", type=int, default=25, help="timed graph replays per cell (>= 20)")
    p.add_argument("--sweep", action="store_true",
                   help="also time the fused gemv under alternative GemvConfigs")
    p.add_argument("--sweep-shapes", nargs="+", default=None, choices=list(SHAPES),
                   help="shapes to sweep (default: --shapes)")
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="start no new cell after this many seconds (rows so far are kept)")
    p.add_argument("--flush", choices=["write", "read"], default="write",
                   help="evict L2 between replays by writing or reading 256 MiB")
    p.add_argument("--out", default="runs/gemv", help="results go to OUT/<timestamp>/")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU (Triton interpreter), tiny shapes, no graphs, eager torch arm")
    return p.parse_args(argv)


def sweep_configs(n_out: int, k: int, rows: int, silu: bool, dry: bool) -> list[GemvConfig]:
    """Around the default: block_n x split_k, then block_k x fold. Configs whose fp32
    tiles cannot fit in registers (> 256 per thread) are left out."""
    base = default_config(n_out, k, rows=rows, silu_mul=silu)
    if dry:
        return [GemvConfig(16, 32, 2)]
    tiles = rows * (2 if silu else 1)
    out = [GemvConfig(bn, base.block_k, s, base.fold)
           for bn in (4, 8, 16, 32) for s in (1, 2, 4, 8)]
    out += [GemvConfig(base.block_n, bk, base.split_k, f)
            for bk in (256, 512, 1024, 2048) for f in (1, 4)]
    keep = []
    for c in dict.fromkeys(out):
        if c != base and c.block_n * c.block_k // c.fold * tiles <= 256 * 32 * NUM_WARPS:
            keep.append(c)
    return keep


def build_arm(arm: str, fusion: str, x, w, g, r, dry: bool):
    """fn() -> output for one arm; the torch arm is compiled (eager in the dry run)."""
    norm, silu, res = "norm" in fusion, "silu" in fusion, "residual" in fusion
    if arm == "cublas":
        return lambda: F.linear(x, w)
    if arm == "kvtax-plain":
        return lambda: gemv(x, w)
    if arm == "torch-unfused":
        def unfused(x, w, g, r):
            h = F.rms_norm(x, x.shape[-1:], g, EPS) if norm else x
            y = F.linear(h, w)
            if silu:
                gate, up = y.chunk(2, dim=-1)
                y = F.silu(gate) * up
            return y + r if res else y

        fn = unfused if dry else torch.compile(unfused, dynamic=False)
        return lambda: fn(x, w, g, r)
    cfg = None if arm == "kvtax" else GemvConfig(*map(int, _untag(arm.partition("@")[2])))
    return lambda: gemv(x, w, norm_weight=g if norm else None, eps=EPS,
                        residual=r if res else None, silu_mul=silu, config=cfg)


def _untag(tag: str) -> list[str]:
    """'n16-k512-s2-f4' -> ['16', '512', '2', '4'] (GemvConfig.tag's inverse)."""
    return [part.lstrip("nksf") for part in tag.split("-")]


def run_shape(name, args, timer, ceiling, t0):
    """Yield one row per arm (and sweep config) of one shape; the inputs built once."""
    dry, rows = args.dry_run, args.rows
    n, k, fusion = (DRY_SHAPES if dry else SHAPES)[name]
    dev, dtype = ("cpu" if dry else "cuda"), torch.bfloat16
    silu = "silu" in fusion
    n_out = n // 2 if silu else n
    gen = torch.Generator(device=dev).manual_seed(n + k)
    x = torch.randn(rows, k, generator=gen, device=dev).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=dev) / k**0.5).to(dtype)
    g = (torch.rand(k, generator=gen, device=dev) + 0.5).to(dtype)
    r = torch.randn(rows, n_out, generator=gen, device=dev).to(dtype)
    arms = list(args.arms)
    if args.sweep and name in (args.sweep_shapes or args.shapes):
        arms += [f"kvtax@{c.tag}" for c in sweep_configs(n_out, k, rows, silu, dry)]
    act = x.numel() * x.element_size() + rows * n_out * x.element_size()
    for arm in arms:
        if time.time() - t0 > args.budget_s:
            print(f"budget of {args.budget_s:.0f}s spent: skipping the rest", flush=True)
            return
        fused = arm not in ("cublas", "kvtax-plain")
        fz = fusion if fused else "none"
        moved = w.numel() * w.element_size() + act
        if fused and "norm" in fusion:
            moved += g.numel() * g.element_size()
        if fused and "residual" in fusion:
            moved += r.numel() * r.element_size()
        row = dict(shape=name, n=n, k=k, rows=rows, fusion=fz, arm=arm,
                   config=arm.partition("@")[2] or (
                       default_config(n_out if fused else n, k, rows=rows, silu_mul=fused and silu,
                                      num_sms=_sms(dry)).tag if arm.startswith("kvtax") else ""),
                   bytes=moved, status="ok", note="")
        try:
            fn = build_arm(arm, fusion, x, w, g, r, dry)
            ref = gemv_reference(x, w, norm_weight=g if "norm" in fz else None, eps=EPS,
                                 residual=r if "residual" in fz else None,
                                 silu_mul="silu" in fz, out_dtype=torch.float32)
            got = fn().float()
            err = (got - ref).abs().max().item()
            row.update(max_abs_err=err, rel_err=err / ref.abs().max().item())
            ms, p20, p80 = timer(fn)
            row.update(median_us=ms * 1e3, p20_us=p20 * 1e3, p80_us=p80 * 1e3)
            row["tbps"] = moved / (ms * 1e-3) / 1e12
            row["frac_ceiling"] = row["tbps"] / ceiling if ceiling == ceiling else None
        except torch.cuda.OutOfMemoryError as exc:
            row.update(status="oom", note=str(exc).splitlines()[0][:120])
        except Exception as exc:  # noqa: BLE001  (one arm's failure must not end the run)
            row.update(status="error",
                       note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        yield row
    del x, w, g, r
    if not dry:
        torch.cuda.empty_cache()


def _sms(dry: bool) -> int:
    return 132 if dry else torch.cuda.get_device_properties(0).multi_processor_count


def markdown(rows: list[dict], config: dict) -> str:
    out = [
        f"Device: {config['device']}; torch {config['torch']}; triton {config['triton']}; "
        f"{config['date']}; git {config['git']}",
        f"Command: `{config['command']}`",
        f"Streaming-read ceiling: {config['read_ceiling_tbps']:.2f} TB/s; "
        f"M = {config['args']['rows']}",
        "",
        "| shape | N | K | fusion | arm | config | median µs | p20–p80 µs | TB/s | % ceiling "
        "| max abs err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['shape']} | {r['n']} | {r['k']} | {r['fusion']} | {r['arm']} | "
                       f"{r['config']} | {r['status']}: {r['note']} | | | | |")
            continue
        frac = f"{100 * r['frac_ceiling']:.0f}%" if r.get("frac_ceiling") else "–"
        out.append(
            f"| {r['shape']} | {r['n']} | {r['k']} | {r['fusion']} | {r['arm']} | {r['config']} | "
            f"{r['median_us']:.1f} | {r['p20_us']:.1f}–{r['p80_us']:.1f} | {r['tbps']:.2f} | "
            f"{frac} | {r['max_abs_err']:.2e} |")
    # per-token total of the main arms over Llama-3.1-8B (32 layers + lm_head), where complete
    ok = {(r["shape"], r["arm"]): r for r in rows if r["status"] == "ok"}
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    totals = []
    for arm in ARMS:
        if all((s, arm) in ok for s in shapes) and set(shapes) == set(PER_TOKEN):
            us = sum(PER_TOKEN[s] * ok[s, arm]["median_us"] for s in shapes)
            totals.append(f"| {arm} | {us / 1e3:.3f} |")
    if totals:
        out += ["", "Per token (32 x (qkv + o + gate_up + down) + lm_head), from the medians:",
                "", "| arm | ms |", "|---|---|", *totals]
    best = {}
    for r in rows:
        if r["status"] == "ok" and r["arm"].startswith("kvtax") and r["arm"] != "kvtax-plain":
            if r["shape"] not in best or r["median_us"] < best[r["shape"]]["median_us"]:
                best[r["shape"]] = r
    if best:
        out += ["", "Fastest fused kvtax config per shape:", "", "| shape | config | µs |",
                "|---|---|---|"]
        out += [f"| {s} | {b['config']} | {b['median_us']:.1f} |" for s, b in best.items()]
    return "\n".join(out) + "\n"


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    dry = args.dry_run
    if dry:
        args.reps = 3
    if not 1 <= args.rows <= 4:
        raise SystemExit(f"--rows {args.rows}: the kernel takes 1..4 rows")
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check the script on CPU")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(
        command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        date=dt.datetime.now().isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(0) if not dry else "cpu (dry run)",
        torch=torch.__version__, triton=triton.__version__, git=_git_commit(), args=vars(args),
    )
    timer = Timer(args.reps, dry, args.flush, dry_calls=1)  # dry: the interpreter is slow
    t0 = time.time()
    if dry:
        ceiling, ceiling_rows = float("nan"), []
    else:
        from kvtax.harness.bench.read_ceiling import read_ceiling

        ceiling, ceiling_rows = read_ceiling(timer)
    config["read_ceiling_tbps"], config["read_ceiling_kernels"] = ceiling, ceiling_rows
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    print(f"device {config['device']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"read ceiling {ceiling:.2f} TB/s", flush=True)
    rows = []
    with open(out_dir / "rows.jsonl", "a") as jsonl:
        for name in args.shapes:
            for row in run_shape(name, args, timer, ceiling, t0):
                row.update(device=config["device"], torch=torch.__version__,
                           triton=triton.__version__, git=config["git"], date=config["date"])
                rows.append(row)
                jsonl.write(json.dumps(row) + "\n")
                jsonl.flush()
                print(_line(row), flush=True)
    summary = markdown(rows, config)
    (out_dir / "summary.md").write_text(summary)
    print(f"\nresults in {out_dir}\n")
    print(summary)
    return rows


def _line(r: dict) -> str:
    head = f"{r['shape']:8s} {r['arm']:34s}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['note']}"
    return (f"{head} {r['median_us']:9.1f} us {r['tbps']:6.2f} TB/s "
            f"err {r['max_abs_err']:.1e}")


if __name__ == "__main__":
    main()
