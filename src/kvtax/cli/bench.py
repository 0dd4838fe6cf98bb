"""`kvtax bench`: sweep contexts x arms x repetitions, one fresh process per cell.

With no arguments it runs on CPU on the built-in tiny model (random weights) in a few
minutes and writes a complete run folder — runs/<UTC time>-bench-tiny/ with config.json,
env.json, rows.jsonl, analysis.json — and a report when `kvtax report` is installed.

An arm is a KV format x an attention path:
  fused     kvtax attention() over the quantized cache (Triton on CUDA)
  fp16      an unquantized fp16 cache read by torch SDPA (the stock baseline)
  unfused   mlx-lm's way: dequantize, materialize [H, L, ctx] scores, softmax, matmul
  dequant   transformers QuantizedCache's way: dequantize the whole cache, then SDPA
  hf-quantized  transformers' own QuantizedCache (reported unavailable without its backend)

Units: TTFT in seconds, decode in ms/token (mean over --decode-tokens steps, EOS ignored),
peaks in bytes per phase (CUDA: allocated, reset at phase start; CPU: peak RSS, reset via
/proc/self/clear_refs). Rows are fsynced one at a time; --resume RUN_DIR finishes a run
that was interrupted (even by SIGKILL) without losing or repeating a cell.

--engine NAME measures another stack with the same protocol (fresh process per cell,
interleaved repetitions, per-phase peaks from the engine's own memory counter, resume,
failures as rows): kvtax (default, the arms above), transformers, llama.cpp, mlx-lm,
openai. Its --kv and --paths are the engine's own (e.g. llama.cpp --kv f16,q8_0,q4_0
--flash-attn on,off); a missing engine package stops before any cell with the command
that installs it.

Examples:
  kvtax bench
  kvtax bench --engine llama.cpp --model SmolLM2-135M-Instruct.Q4_1.gguf \\
      --kv f16,q8_0,q4_0 --flash-attn on,off --threads 4 --contexts 512,1k,2k
  kvtax bench --engine openai --url fp16=http://127.0.0.1:8000 \\
      --url int8=http://127.0.0.1:8001 --contexts 1k,4k
  kvtax bench --device cuda --model llama-3.1-8b --contexts 4k,16k,32k,64k,128k \\
      --kv fp16,int8,int4 --paths fused,fp16,unfused,dequant --reps 5 --presize
  kvtax bench --resume runs/20260101T000000Z-bench-tiny
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from kvtax.cli.options import add_allow_long, add_engine, engine_options
from kvtax.errors import OptionError
from kvtax.cli.validate import at_least, parse_contexts, size

DEFAULT_CPU_CONTEXTS = "128,256,512,1024"


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="sweep contexts x KV formats x attention paths; rows to runs/<time>-<name>/",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_grid_options(p)
    _add_run_options(p)
    p.set_defaults(func=run)


def _add_grid_options(p: argparse.ArgumentParser) -> None:
    """What the sweep measures: model, contexts, arms, repetitions, phases."""
    p.add_argument("--model", default="tiny",
                   help="built-in config name, local HF folder, .gguf file or hub id "
                        "(default tiny); its config is read before any cell is planned")
    p.add_argument("--level", choices=["model", "attention"], default="model",
                   help="whole decoder (default) or the attention op alone over one layer")
    p.add_argument("--contexts", type=parse_contexts, default=None,
                   help=f"prompt lengths, k = 1024 (default {DEFAULT_CPU_CONTEXTS} on CPU, "
                        "4k,16k,32k,64k,128k on CUDA)")
    add_engine(p, extra="; kvtax's arms are the paths below")
    p.add_argument("--kv", type=_csv, default=None,
                   help="KV caches: fp16,int8,int4,fp8,k8v4,int4-g32 ... (default fp16,int8,int4); "
                        "FORMAT@s<S>r<R> (fp16 sinks/recent) and FORMAT:L<i>=FORMAT (per-layer) "
                        "run on the fused path at --level model (kvtax.harness.kv_arm); "
                        "another engine's own cache settings (its default otherwise)")
    p.add_argument("--paths", type=_csv, default=None,
                   help="attention paths (default all: fused,fp16,unfused,dequant,hf-quantized; "
                        "an arm that cannot run here gets rows with status unavailable); "
                        "another engine's own paths (its default otherwise)")
    add_allow_long(p)
    p.add_argument("--flash-attn", type=_csv, default=None, metavar="on,off",
                   help="llama.cpp: flash attention on, off or both (the paths fa / nofa; "
                        "default on)")
    p.add_argument("--reps", type=at_least(1), default=3,
                   help="repetitions per cell, >= 1 (default 3)")
    p.add_argument("--warmup", type=at_least(0), default=1,
                   help="warm-up cells per arm, run first and excluded from statistics (default 1)")
    p.add_argument("--decode-tokens", type=at_least(1), default=16,
                   help="timed decode steps per cell, EOS ignored (default 16)")
    p.add_argument("--chunk-size", type=at_least(1), default=2048,
                   help="prefill chunk in tokens (llama.cpp's n_batch, mlx-lm's "
                        "prefill_step_size; default 2048)")
    p.add_argument("--phases", type=_csv, default=["prefill", "decode"],
                   help="prefill,decode (default both); 'decode' alone runs prefill unmeasured")
    p.add_argument("--presize", action="store_true",
                   help="preallocate caches to prompt + decode tokens: no growth in any window "
                        "(separates a resize's cost from the format's; needed for CUDA-graph "
                        "decode)")
    p.add_argument("--quantized-kv-start", type=int, default=0,
                   help="keep the first N prompt tokens in an fp16 cache, then convert "
                        "(mlx-lm's quantized_kv_start; default 0)")
    p.add_argument("--seed", type=int, default=0,
                   help="order seed (also model weights and prompt; default 0)")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """Where rows go and how cells run: folder, resume, device, workers, limits, report."""
    p.add_argument("--out", default="runs", help="parent folder of run folders (default runs)")
    p.add_argument("--name", default=None, help="run folder suffix (default bench-<model>)")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="finish an interrupted run: skips cells that already have a row")
    p.add_argument("--timeout", type=_positive_float, default=None,
                   help="seconds per cell before it is killed (row status timeout; default 600)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--dtype", default=None,
                   help="model dtype: float32 (CPU default), bfloat16 (CUDA default), float16")
    p.add_argument("--claims", metavar="FILE", default=None,
                   help="JSON list of predictions to judge, e.g. "
                        '[{"metric": "slope_ratio", "arm": "int8", "range": [1.8, 2.1]}]')
    p.add_argument("--cv-threshold", type=float, default=0.10,
                   help="robust CV above which a cell is flagged and left out of fits (0.10)")
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="threads per CPU cell, torch's or the engine's (default 1: batch-1 "
                        "ops are too small to split and a thread pool adds noise)")
    p.add_argument("--worker", choices=["forkserver", "subprocess"], default="forkserver",
                   help="fresh process per cell: forked from a preloaded server (default) "
                        "or a new interpreter each time")
    p.add_argument("--heads", default="32/8",
                   help="attention level without a built-in model: query/KV heads (32/8)")
    p.add_argument("--head-dim", type=at_least(1), default=128,
                   help="attention level without a built-in model: head dim (128)")
    p.add_argument("--mem-limit", type=size, default=None,
                   help="CPU only: cap each cell's address space this far above its start "
                        "(e.g. 2GiB) so a large allocation really fails (CUDA needs a huge "
                        "address space, so do not use it there)")
    p.add_argument("--force-oom", metavar="PHASE[:CELL]", default=None,
                   help="harness self-test: raise OutOfMemoryError in PHASE (setup, prefill, "
                        "decode) of cells whose id contains CELL")
    p.add_argument("--cuda-graph", choices=["auto", "off"], default="auto",
                   help="every path's decode: CUDA graph when the runner can (auto; needs "
                        "--presize; the baselines are captured too, as masked reads of the "
                        "presized storage) or eager (off)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of this invocation: start no cell that would likely "
                        "end past it (judged from the slowest finished cell of that arm and "
                        "context); finish later with --resume (also applies when resuming)")
    p.add_argument("--max-context", type=_limits, default={}, metavar="PATH=CTX,...",
                   help="largest context a path or arm runs, e.g. unfused=64k,int4/dequant=32k "
                        "(0: none, the arm is left out); larger cells become rows with status "
                        "skipped and the reason")
    p.add_argument("--skip-after-failure", action="store_true",
                   help="after an arm's OOM or timeout, write its cells at that context and "
                        "above as skipped rows instead of running them again")
    p.add_argument("--rounds", action="store_true",
                   help="order repetition by repetition (shuffled within each), so a sweep cut "
                        "short by --budget-s holds whole repetitions of every cell")
    p.add_argument("--no-report", action="store_true", help="skip writing the report")


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return x


def _limits(text: str) -> dict[str, int]:
    """"unfused=64k,fp8/dequant=0" → {"unfused": 65536, "fp8/dequant": 0} (0: left out)."""
    out = {}
    for part in _csv(text):
        key, sep, ctx = part.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"--max-context wants PATH=CTX, got {part!r}")
        out[key.strip()] = 0 if ctx.strip() == "0" else parse_contexts(ctx)[0]
    return out


def _claims(path: str) -> list[dict[str, Any]]:
    try:
        claims = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise OptionError(f"--claims {path} is not valid JSON ({exc})") from None
    if isinstance(claims, dict):
        claims = claims.get("claims", [])
    if not isinstance(claims, list):
        raise OptionError(f"--claims {path} must hold a JSON list of claims")
    return claims


FLASH_ATTN_PATHS = {"on": "fa", "off": "nofa"}  # llama.cpp's path names (engines/base.py)


def engine_arms(args: argparse.Namespace) -> tuple[list[str], list[str], dict[str, Any]]:
    """(kvs, paths, engine_options) from --engine and its flags (engine defaults applied)."""
    if args.engine == "kvtax":
        if args.flash_attn or args.url or args.engine_option:
            raise argparse.ArgumentTypeError(
                "--flash-attn, --url and --engine-option need --engine (not kvtax)")
        return (args.kv or ["fp16", "int8", "int4"],
                args.paths or ["fused", "fp16", "unfused", "dequant", "hf-quantized"], {})
    from kvtax.harness.engines import require_engine

    eng = require_engine(args.engine)  # missing package: one line naming its install command
    options = engine_options(args)
    kvs, paths = args.kv, args.paths
    if args.url:
        kvs = kvs or list(options["urls"])
    if args.flash_attn:
        bad = [f for f in args.flash_attn if f not in FLASH_ATTN_PATHS]
        if bad or paths:
            raise argparse.ArgumentTypeError(
                "--flash-attn takes on, off or on,off, and replaces --paths")
        paths = [FLASH_ATTN_PATHS[f] for f in args.flash_attn]
    return kvs or eng.default_kvs(), paths or eng.default_paths(), options


def _config(args: argparse.Namespace) -> Any:
    from kvtax.harness.bench.plan import SweepConfig

    cuda = args.device.startswith("cuda")
    contexts = args.contexts or parse_contexts("4k,16k,32k,64k,128k" if cuda
                                               else DEFAULT_CPU_CONTEXTS)
    claims = _claims(args.claims) if args.claims else []
    hq, _, hkv = args.heads.partition("/")
    if not (hq.isdigit() and (hkv or hq).isdigit() and int(hq) > 0 and int(hkv or hq) > 0):
        raise OptionError(f"--heads takes QUERY/KV head counts like 32/8, not {args.heads!r}")
    kvs, paths, options = engine_arms(args)
    if args.engine != "kvtax" and args.level != "model":
        raise argparse.ArgumentTypeError(f"--level {args.level} is kvtax's own; engine "
                                         f"{args.engine} measures whole models")
    return SweepConfig(
        engine=args.engine, engine_options=options,
        model=args.model, level=args.level, contexts=contexts, kvs=kvs, paths=paths,
        reps=args.reps, warmup=args.warmup, decode_tokens=args.decode_tokens,
        chunk_size=args.chunk_size, phases=args.phases, presize=args.presize,
        quantized_kv_start=args.quantized_kv_start, seed=args.seed, device=args.device,
        dtype=args.dtype or ("bfloat16" if cuda else "float32"),
        timeout_s=args.timeout or 600.0, cv_threshold=args.cv_threshold, claims=claims,
        threads=args.threads, worker=args.worker, heads=int(hq), kv_heads=int(hkv or hq),
        head_dim=args.head_dim, cuda_graph=None if args.cuda_graph == "auto" else False,
        max_context=args.max_context, skip_after_failure=args.skip_after_failure,
        rounds=args.rounds,
    )


def run(args: argparse.Namespace) -> int:
    """Validate everything (model config, contexts, arms) before the first cell, sweep, then
    report; the exit status says whether the run's cells were measured (kvtax.cli.outcome)."""
    from kvtax.cli.outcome import report_outcome
    from kvtax.cli.validate import check_arms, check_contexts, check_model
    from kvtax.harness.bench.plan import SweepConfig
    from kvtax.harness.store import RunStore
    from kvtax.harness.bench.sweep import RESUME_KEYS, check_engine, run_sweep

    overrides: dict[str, Any] = {}
    if args.mem_limit:
        overrides["mem_limit_bytes"] = args.mem_limit
    if args.force_oom:
        os.environ["KVTAX_FORCE_OOM"] = args.force_oom
    if args.resume:
        stored = RunStore.open(args.resume, kind="bench", required=RESUME_KEYS).config()
        cfg = SweepConfig.from_dict(stored)
        if args.timeout:
            cfg.timeout_s = args.timeout
    else:
        cfg = _config(args)
        if cfg.engine == "kvtax":
            cfg.kvs = check_arms(",".join(cfg.kvs))
        if cfg.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise OptionError("--device cuda but torch sees no CUDA device")
    cfg.allow_long_context = cfg.allow_long_context or args.allow_long_context
    if _checks_model(cfg):
        check_contexts(cfg.contexts, check_model(cfg.model), cfg.allow_long_context)
    try:
        check_engine(cfg)  # a missing engine package: one line naming its install command
        if not cfg.arms():
            raise OptionError("no arms: check --kv and --paths (openai: --url NAME=URL)")
    except ValueError as exc:  # a format or path the user mistyped, a group size that misfits
        raise OptionError(str(exc)) from None
    store = run_sweep(cfg, out=args.out, name=args.name, resume=args.resume,
                      cell_overrides=overrides, budget_s=args.budget_s,
                      command=shlex.join(["kvtax", "bench", *sys.argv[2:]]) if
                      sys.argv[1:2] == ["bench"] else None)
    finish(store, cfg, report=not args.no_report)
    return report_outcome(store.rows(), "kvtax bench", "cells")


def _checks_model(cfg: Any) -> bool:
    """Whether the model's config is read up front: kvtax's model level always; another
    engine's model when kvtax can read it (a built-in name, a local folder or .gguf file);
    an openai arm's model is the server's business."""
    if cfg.engine == "kvtax":
        return cfg.level == "model" or _names_a_model(cfg.model)
    if cfg.engine == "openai":
        return False
    from kvtax.models import CONFIG_NAMES

    name = cfg.model
    if name.lower() in CONFIG_NAMES or Path(name).expanduser().exists():
        return True
    # a path that is not there is refused up front; a hub id is the engine loader's to find
    return name.lower().endswith(".gguf") or name.startswith((".", "~", "/"))


def _names_a_model(name: str) -> bool:
    """At attention level a plain word is only a label (--heads/--head-dim give the shape);
    a built-in name, a path, a .gguf file or an org/name id must be a model that loads."""
    from kvtax.models import CONFIG_NAMES

    return (name.lower() in CONFIG_NAMES or "/" in name or name.startswith((".", "~"))
            or name.lower().endswith(".gguf"))


def finish(store: Any, cfg: Any, report: bool = True) -> Path | None:
    """Print the headline numbers; write the report (which writes analysis.json) or, without
    one, analysis.json alone. Returns the report's path, if one was written."""
    from kvtax.harness.analysis.analyze import summarize
    from kvtax.harness.analysis.summary import print_summary

    summary = summarize(store.rows(), cv_threshold=cfg.cv_threshold, claims=cfg.claims)
    print_summary(summary)
    out = None
    if report:
        try:
            from kvtax.harness.report.write import write_report
        except ImportError:
            print("(kvtax report is not installed here; rows and analysis.json are complete)")
        else:
            try:
                out = write_report(store.path)
                print(f"report: {out}")
            except Exception as exc:  # the measurements are safe on disk whatever happens
                print(f"kvtax bench: the report failed ({exc!r}); rerun `kvtax report "
                      f"{store.path}`", file=sys.stderr)
    if out is None:
        path = store.path / "analysis.json"
        path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return out
