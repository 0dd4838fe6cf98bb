"""Decode with transformers' `generate`: DynamicCache vs kvtax int8/int4 vs QuantizedCache (quanto).

A Llama-3.1-8B-shaped model with random bf16 weights (built from a config, no download)
reads a `--context`-token prompt and generates `--new-tokens` tokens, once per (arm, mode):

  arms   dynamic       transformers' own cache in the model dtype (DynamicCache / StaticCache)
         kvtax-int8    KVTaxCache(kv="int8") read in place by the kvtax attention
         kvtax-int4    KVTaxCache(kv="int4")
         quanto-int4   transformers' QuantizedCache(backend="quanto", nbits=4), which
                       dequantizes the whole cache every step (row says so if not importable)
  modes  eager         growing caches, no compilation
         static        preallocated caches (StaticCache / KVTaxCache(max_cache_len=…)), no compile
         compiled      static caches + transformers' auto torch.compile of the decode step,
                       once per `--compile-modes` entry ("compiled:reduce-overhead" uses CUDA
                       graphs; each compiled row records dynamo's counters: compiles,
                       recompiles, CUDA-graph partitions)

Each row: TTFT, decode tokens/s with per-token median/p20/p80 ms, peak memory above the
weights in the prefill and in the decode phase (split by a logits processor that runs
right after the prefill forward), resident cache bytes. Timing uses CUDA events recorded
without synchronizing, so the decode loop is not stalled by the measurement. A failure
(OOM included) becomes a row with its status. Every row runs once to warm up (Triton JIT,
torch.compile) and is then measured.

    python benchmarks/hf_decode.py --context 32768 --new-tokens 128 --out results/hf_decode
    python benchmarks/hf_decode.py --device cpu --config tiny --context 64 --new-tokens 4

Writes `<out>/rows.json` (rows + config + environment) and `<out>/table.md`, prints the
markdown table last. `--out x.json` writes that file instead (table beside it). Each row is
also appended to `<out>/rows.jsonl` and fsynced the moment it finishes, so a run killed
at its time limit keeps every finished row; `--table <out>/rows.jsonl` prints their table.

quanto on CUDA: rather than JIT-building quanto's whole CUDA extension (Marlin/AWQ GEMMs,
minutes of nvcc) at the first dequantize, `kvtax.harness.bench.hf_quantized.prepare_quanto`
builds the one kernel its KV cache calls (`unpack`) from quanto's source; the quanto row
records how unpack ran (`quanto_unpack`).

`--budget-s S` starts no row that would likely end past S seconds after the start (judged
from the slowest finished row of the same mode kind: eager, static, compiled); such rows
say `skipped: time budget`. `--warmup-tokens` shortens the untimed warm-up generation
(it compiles and JITs; the measured generation is always `--new-tokens` long).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, LogitsProcessor, LogitsProcessorList

import kvtax.hf as kh
from kvtax.harness.bench.hf_quantized import prepare_quanto, quantized_cache_bytes
from kvtax.hf.cache import cache_kwarg
from kvtax.hf.models import llama31_8b_config, tiny_config

ARMS = ("dynamic", "kvtax-int8", "kvtax-int4", "quanto-int4")
QUANTO_UNPACK: dict[str, str] = {}  # how quanto's unpack runs here, once prepared
MODES = ("eager", "static", "compiled")
GIB = 2**30


class PhaseClock(LogitsProcessor):
    """Marks each forward's end: generate calls logits processors right after every forward.

    The first call ends the prefill: the peak allocation so far is the prefill's, and the
    counter restarts for the decode. CUDA events are recorded, never waited on.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.prefill_peak = 0

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.marks.append(self.mark())
        if len(self.marks) == 2 and self.cuda:  # marks[0] is the start of generate
            self.prefill_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return scores

    def seconds(self) -> list[float]:
        """Times of each mark after the first, relative to it."""
        if self.cuda:
            torch.cuda.synchronize()
            return [self.marks[0].elapsed_time(m) / 1e3 for m in self.marks[1:]]
        return [m - self.marks[0] for m in self.marks[1:]]


def make_cache(arm: str, mode: str, model, max_len: int):
    """The cache object for one row, or a string saying why the row cannot run."""
    cfg = model.config
    static = mode != "eager"
    if arm == "dynamic":
        return (
            transformers.StaticCache(config=cfg, max_cache_len=max_len)
            if static
            else DynamicCache(config=cfg)
        )
    if arm.startswith("kvtax-"):
        return kh.KVTaxCache(
            cfg, kv=arm.split("-", 1)[1], max_cache_len=max_len if static else None
        )
    if arm == "quanto-int4":
        if static:
            return "skipped: QuantizedCache has no preallocated/compileable form"
        try:
            importlib.import_module("optimum.quanto")
            # On CUDA quanto would JIT-build its whole extension (minutes) at the first
            # dequantize; build only the unpack kernel its KV cache uses (hf_quantized).
            QUANTO_UNPACK.setdefault("how", prepare_quanto(model.device))
        except Exception as exc:  # ImportError, or a broken extension build
            return f"unavailable: optimum.quanto does not import ({type(exc).__name__})"
        return transformers.QuantizedCache(backend="quanto", config=cfg, nbits=4)
    raise ValueError(f"unknown arm {arm!r}")


def cache_bytes(cache) -> int | None:
    """Resident K/V bytes: kvtax's allocation; transformers' dense tensors; QuantizedCache's
    quantized tensors plus its unquantized residual."""
    if isinstance(cache, kh.KVTaxCache):
        return cache.nbytes
    if isinstance(cache, transformers.QuantizedCache):
        return quantized_cache_bytes(cache)
    total = 0
    for layer in getattr(cache, "layers", []):
        if isinstance(getattr(layer, "keys", None), torch.Tensor) and not hasattr(
            layer, "_quantized_keys"
        ):
            total += layer.keys.nbytes + layer.values.nbytes
        else:
            return None
    return total


def _dynamo_counters() -> dict:
    """Compiles, recompiles, graph breaks and CUDA-graph skips of this row (a compiled row
    that runs its graphs without CUDA graphs is host-bound: the table alone hides why)."""
    from torch._dynamo.utils import counters

    keep = ("stats", "recompiles", "graph_break", "frames", "inductor")
    out = {k: dict(v) for k, v in counters.items() if v and k in keep}
    if "inductor" in out:  # its many pattern-matcher/cache counts are noise here
        out["inductor"] = {k: v for k, v in out["inductor"].items() if "cudagraph" in k}
    return out


def _generate_kwargs(ids: torch.Tensor, mode: str, args, device: torch.device) -> dict:  # noqa: ANN001
    """model.generate's keywords for one row: greedy, exactly --new-tokens, compiled or not."""
    kwargs: dict = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    if mode.startswith("compiled"):
        cc = transformers.CompileConfig(mode=mode.split(":", 1)[1], fullgraph=False)
        cc._compile_all_devices = device.type != "cuda"  # CPU compiles only when asked
        kwargs["compile_config"] = cc
    else:
        kwargs["disable_compile"] = True
    return kwargs


def _warm_then_measure(model, cache, ids, kwargs: dict, n_tokens: tuple[int, int],  # noqa: ANN001
                       device: torch.device):  # noqa: ANN202
    """generate twice on the same cache (warm-up, then measured: compiled graphs and CUDA
    graphs keep its storage addresses); (token times s, wall s, output ids, warnings,
    the measured run's PhaseClock)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n_new in n_tokens:
            # Peaks are taken above the weights, so storage a reset keeps still counts, as
            # does a dynamic cache's regrowth.
            cache.reset()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            clock = PhaseClock(device)
            clock.marks.append(clock.mark())
            wall = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    ids,
                    logits_processor=LogitsProcessorList([clock]),
                    **{cache_kwarg(model): cache},
                    **dict(kwargs, max_new_tokens=n_new, min_new_tokens=n_new),
                )
            times = clock.seconds()
            wall = time.perf_counter() - wall
    return times, wall, out, caught, clock


def _timing_fields(times: list[float], batch: int) -> dict:
    """TTFT, decode tokens/s and ms per token (median, p20, p80, every step) of one run."""
    steps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return dict(
        ttft_s=times[0],
        decode_tok_s=batch * len(steps) / (times[-1] - times[0]) if steps else None,
        ms_per_token_median=1e3 * statistics.median(steps) if steps else None,
        ms_per_token_p20=1e3 * _quantile(steps, 0.2) if steps else None,
        ms_per_token_p80=1e3 * _quantile(steps, 0.8) if steps else None,
        step_ms=[round(1e3 * x, 3) for x in steps],  # spikes and drifts show here
    )


def run_row(model, arm: str, mode: str, args, device: torch.device) -> dict:  # noqa: ANN001
    """One (arm, mode) row: a cache of the arm's kind, a warm-up generate, then the
    measured one; status "ok" with its timings, or why not (oom, error, skipped)."""
    row: dict = {"arm": arm, "mode": mode, "context": args.context,
                 "new_tokens": args.new_tokens, "batch": args.batch}
    max_len = args.context + args.new_tokens + 1  # +1: a deferred stop check runs one extra step
    if mode.startswith("compiled"):
        from torch._dynamo.utils import counters

        counters.clear()  # this row's compiles only (see _dynamo_counters)
    if device.type == "cuda":
        torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0  # weights, no cache
    cache = make_cache(arm, mode, model, max_len)
    if isinstance(cache, str):
        row["status"] = cache
        return row
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    shape = (args.batch, args.context)
    ids = torch.randint(3, model.config.vocab_size, shape, generator=gen).to(device)
    kwargs = _generate_kwargs(ids, mode, args, device)
    # The warm-up compiles and JITs; its length does not change the graphs, but it needs a
    # few decode steps: dynamo recompiles once when a size first changes between steps.
    warmup_tokens = min(args.new_tokens, max(4, args.warmup_tokens or args.new_tokens))
    row["warmup_tokens"] = warmup_tokens
    installed = arm.startswith("kvtax-")
    if installed:
        kh.install(model)
    try:
        times, wall, out, caught, clock = _warm_then_measure(
            model, cache, ids, kwargs, (warmup_tokens, args.new_tokens), device)
        row.update(
            status="ok",
            **_timing_fields(times, args.batch),
            dynamo=_dynamo_counters() if mode.startswith("compiled") else None,
            generated=int(out.shape[1] - ids.shape[1]),
            wall_s=wall,
            cache_bytes=cache_bytes(cache),
            notes=sorted({str(w.message)[:160] for w in caught if "kvtax" in str(w.message)}),
        )
        if device.type == "cuda":
            row["prefill_peak_gib"] = (clock.prefill_peak - base) / GIB
            row["decode_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
    except torch.cuda.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc).splitlines()[0][:300])
    except Exception as exc:  # one failing arm must not lose the others
        row.update(status=f"error: {type(exc).__name__}", error=str(exc)[:300],
                   traceback=traceback.format_exc()[-2000:])
    finally:
        if installed:
            kh.uninstall(model)
        del cache
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if mode.startswith("compiled"):
            torch._dynamo.reset()
    return row


def _brief(row: dict) -> str:
    """One progress line: status, TTFT, ms/token, row time."""
    parts = [row["status"]]
    if row.get("ttft_s") is not None:
        parts.append(f"TTFT {row['ttft_s']:.3f} s")
    if row.get("ms_per_token_median") is not None:
        parts.append(f"{row['ms_per_token_median']:.2f} ms/token")
    if row.get("row_wall_s") is not None:
        parts.append(f"row {row['row_wall_s']:.0f} s")
    if row.get("error"):
        parts.append(str(row["error"]).splitlines()[0][:160])
    return ", ".join(parts)


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def environment(device: torch.device) -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=pathlib.Path(__file__).parent,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    env = {
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": commit,
    }
    for mod in ("triton", "optimum.quanto"):
        try:
            env[mod] = getattr(__import__(mod, fromlist=["_"]), "__version__", "?")
        except ImportError:
            env[mod] = None
    return env


def table(rows: list[dict]) -> str:
    def f(x, spec):
        return "—" if x is None else format(x, spec)

    head = ["arm", "mode", "status", "TTFT s", "decode tok/s", "ms/token med [p20, p80]",
            "prefill peak GiB", "decode peak GiB", "cache MiB"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms = "—"
        if r.get("ms_per_token_median") is not None:
            ms = f"{r['ms_per_token_median']:.2f} "
            ms += f"[{r['ms_per_token_p20']:.2f}, {r['ms_per_token_p80']:.2f}]"
        cb = r.get("cache_bytes")
        cells = [
            r["arm"], r["mode"], r["status"], f(r.get("ttft_s"), ".3f"),
            f(r.get("decode_tok_s"), ".1f"), ms, f(r.get("prefill_peak_gib"), ".2f"),
            f(r.get("decode_peak_gib"), ".2f"), f(None if cb is None else cb / 2**20, ".2f"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--config",
        choices=("llama31-8b", "tiny"),
        default="llama31-8b",
        help="model shape: Llama-3.1-8B (random weights) or a 2-layer toy",
    )
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--context", type=int, default=32768, help="prompt tokens (default 32768)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated (default 128)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument(
        "--modes",
        default=None,
        help="comma list of eager, static, compiled (default: eager,compiled on CUDA, "
        "eager,static on CPU, where compiling takes minutes)",
    )
    p.add_argument(
        "--compile-modes",
        default="reduce-overhead,default",
        help="torch.compile modes, one set of compiled rows each (reduce-overhead is "
        "transformers' default; default compiles without CUDA graphs)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (or a .json file path)")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="tokens generated by each row's untimed warm-up (default: --new-tokens)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no row that would likely end past this many seconds")
    p.add_argument("--table", metavar="ROWS_JSONL", default=None,
                   help="print the markdown table of a rows.jsonl (e.g. of a killed run) and exit")
    args = p.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in args.arms if a not in ARMS]
    if bad:
        p.error(f"unknown arms {bad}; choose from {ARMS}")
    default_modes = "eager,compiled" if args.device.startswith("cuda") else "eager,static"
    args.modes = [m for m in (args.modes or default_modes).split(",") if m]
    if any(m not in MODES for m in args.modes):
        p.error(f"modes must be among {MODES}")
    cms = [c for c in args.compile_modes.split(",") if c]
    args.modes = [
        x for m in args.modes for x in ([f"{m}:{c}" for c in cms] if m == "compiled" else [m])
    ]
    return args


def _jsonl_path(out: str | None) -> pathlib.Path | None:
    if not out:
        return None
    p = pathlib.Path(out)
    return p.with_suffix(".jsonl") if p.suffix == ".json" else p / "rows.jsonl"


def append_row(path: pathlib.Path | None, row: dict) -> None:
    """One JSON line, flushed and fsynced before the next row starts."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def mode_kind(mode: str) -> str:
    return mode.split(":", 1)[0]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.table:
        rows = [json.loads(line) for line in open(args.table) if line.strip()]
        print(table(rows))
        return rows
    t_start = time.perf_counter()
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    cfg = llama31_8b_config() if args.config == "llama31-8b" else tiny_config("llama", vocab=1024)
    torch.manual_seed(args.seed)
    print(f"building {args.config} ({args.dtype}, random weights) on {device}…", file=sys.stderr)
    with device:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    env = environment(device)
    # inductor's cudagraph_skip_dynamic_graphs stays at torch's default (off): on, it cut
    # the static decode graphs into 258 CUDA-graph partitions and the compiled rows ran
    # host-bound at 18-38 ms/token instead of 10-18 (H200: the counters
    # each compiled row now records). KVTAX_HF_SKIP_DYNAMIC=1 turns it on to compare.
    skip_dynamic = os.environ.get("KVTAX_HF_SKIP_DYNAMIC", "0") == "1"
    if skip_dynamic:
        import torch._inductor.config as inductor_config

        inductor_config.triton.cudagraph_skip_dynamic_graphs = True
    env["cudagraph_skip_dynamic_graphs"] = skip_dynamic
    if device.type == "cuda":
        env["weights_gib"] = torch.cuda.memory_allocated() / GIB
    jsonl = _jsonl_path(args.out)
    if jsonl is not None and jsonl.exists():
        jsonl.unlink()  # this run's rows only, like rows.json
    slowest: dict[str, float] = {}  # mode kind -> slowest row's wall seconds
    rows = []
    for mode in args.modes:
        for arm in args.arms:
            elapsed = time.perf_counter() - t_start
            guess = slowest.get(mode_kind(mode), 0.0)
            if args.budget_s is not None and elapsed + guess > args.budget_s:
                row = {"arm": arm, "mode": mode, "context": args.context,
                       "new_tokens": args.new_tokens, "batch": args.batch,
                       "status": f"skipped: time budget ({elapsed:.0f} s used, a {mode} row "
                                 f"took up to {guess:.0f} s, budget {args.budget_s:.0f} s)"}
            else:
                print(f"  {arm} / {mode} … ({elapsed:.0f} s)", file=sys.stderr, flush=True)
                t_row = time.perf_counter()
                row = run_row(model, arm, mode, args, device)
                row["row_wall_s"] = time.perf_counter() - t_row
                if not row["status"].startswith(("skipped", "unavailable")):
                    kind = mode_kind(mode)
                    slowest[kind] = max(slowest.get(kind, 0.0), row["row_wall_s"])
            row.update(device=env["device"], model=args.config, dtype=args.dtype)
            if arm == "quanto-int4" and "how" in QUANTO_UNPACK and row["status"] == "ok":
                row["quanto_unpack"] = QUANTO_UNPACK["how"]
            rows.append(row)
            append_row(jsonl, row)
            print(f"    {_brief(row)}", file=sys.stderr, flush=True)
    md = table(rows)
    if args.out:
        out = pathlib.Path(args.out)
        json_path = out if out.suffix == ".json" else out / "rows.json"
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(
            json.dumps({"config": vars(args), "environment": env, "rows": rows}, indent=2)
        )
        json_path.with_name(
            json_path.stem + "_table.md" if out.suffix == ".json" else "table.md"
        ).write_text(md + "\n")
    print(md)
    return rows


if __name__ == "__main__":
    main()
