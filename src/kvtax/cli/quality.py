"""`kvtax quality`: how much a quantized KV cache changes a model's next-token predictions.

For each context c, the first c + 1 tokens of a text are run teacher-forced (chunked
prefill through the caches) once with fp16 KV and once per format. Over the last N
positions (--tail) each format's row reports, against the fp16-KV run of the same model:
mean KL(fp16 || format) in nats (also its max, median and standard error), top-1
agreement (fraction of positions where both pick the same token), perplexity of the
text's real next tokens and its delta (and both over all c positions), and per layer the
relative error ||o - o_fp16|| / ||o_fp16|| of attention outputs over the same q and the
run's own K/V (an fp16 shadow cache of each layer; per query head too).

Formats: fp16 bf16 fp8 int8 int4 (int-g<group>), K/V pairs (k8v4), Hadamard rotation
(+hk keys, +hkv keys and values), and fp16 sink/recent tokens around a quantized body:
<spec>@s<S>r<R>, e.g. int4+hk@s4r128 keeps positions 0..3 and each query's 128 nearest
keys in fp16 and reads the rest from int4.

Rows (kind "quality") go to a new run folder; `kvtax report RUN` renders the tables.

Examples:
  kvtax quality --model tiny --contexts 256 --kv int8,int4          # smoke test, random weights
  kvtax quality --model SmolLM2-135M-Instruct.Q4_1.gguf --contexts 512,2048 \\
      --kv int8,int4,int4+hk,int4+hkv,int4+hk@s4r128,k8v4
  kvtax quality --resume runs/20260101T000000Z-quality             # finish an interrupted run
"""

from __future__ import annotations

import argparse
import shlex

from kvtax.cli.options import add_allow_long, add_model_dtype, add_run_folder, add_threads
from kvtax.cli.validate import at_least
from kvtax.errors import OptionError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quality",
        help="KL, top-1 agreement, perplexity and per-layer attention error of KV formats "
             "against the fp16-KV run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny",
                   help="built-in config name (random weights), HF folder, .gguf file or hub id "
                        "(default tiny)")
    p.add_argument("--contexts", default="512,2048",
                   help="comma-separated context lengths in tokens, k = 1024 (default 512,2048)")
    add_allow_long(p)
    p.add_argument("--kv", default="int8,int8+hk,int4,int4+hk",
                   help="comma-separated KV formats compared with the baseline (default "
                        "int8,int8+hk,int4,int4+hk); `FMT/L0:fp16/L8:int8` keeps the "
                        "listed layers in another format")
    p.add_argument("--tail", type=at_least(1), default=128,
                   help="scored positions: the last N of each context (default 128)")
    p.add_argument("--text", default=None,
                   help="text file to score (default: the prose of CPython's "
                        "pydoc_data/topics.py)")
    p.add_argument("--baseline", default="fp16",
                   help="KV format of the reference run (default fp16)")
    p.add_argument("--sliding-kv", default=None,
                   help="KV format of sliding-window layers (default: the arm's format)")
    # float32 on CUDA too: a bf16 model amplifies any perturbation of the cache, so KL
    # against a bf16 run reads 2-4x higher than the cache's own error (Qwen2.5-Coder-0.5B
    # int8+hk+ck at 32k: 1.7e-3 bf16 vs 5.1e-4 float32, docs/QUALITY.md session 5).
    add_model_dtype(p, cuda_default="float32",
                    why="; a bf16 model inflates KL 2-4x, see docs/QUALITY.md")
    p.add_argument("--chunk-size", type=at_least(1), default=256,
                   help="prefill chunk in tokens; logits of a whole chunk are held at once "
                        "(default 256)")
    add_threads(p)
    add_run_folder(p, "quality", "cells")
    p.set_defaults(func=run)


def _command(args: argparse.Namespace, dtype: str) -> str:
    """The command line that reproduces this run, every default spelled out."""
    words = ["kvtax", "quality", "--model", args.model, "--contexts", args.contexts,
             "--kv", args.kv, "--tail", str(args.tail), "--baseline", args.baseline,
             "--device", args.device, "--dtype", dtype, "--chunk-size", str(args.chunk_size)]
    for flag, value in (("--text", args.text), ("--sliding-kv", args.sliding_kv)):
        if value is not None:
            words += [flag, str(value)]
    return shlex.join(words)


def _check(args: argparse.Namespace) -> list[int]:
    """Contexts, formats and model, refused before a model loads; [] on --resume."""
    from kvtax.cli.validate import check_contexts, check_formats, check_model, parse_contexts
    from kvtax.harness.quality import RESUME_KEYS
    from kvtax.harness.store import RunStore

    if args.resume:
        stored = RunStore.open(args.resume, kind="quality", required=RESUME_KEYS).config()
        check_model(stored["model"])
        return []
    try:
        contexts = parse_contexts(args.contexts)
    except argparse.ArgumentTypeError as exc:
        raise OptionError(f"--contexts: {exc}") from None
    kvs = [k.strip() for k in args.kv.split(",") if k.strip()]
    check_formats([k.split("/")[0] for k in kvs], hybrid=True)
    check_formats([args.baseline], "--baseline")
    # +1: each context scores the token after it.
    check_contexts([c + 1 for c in contexts], check_model(args.model), args.allow_long_context)
    return contexts


def run(args: argparse.Namespace) -> int:
    """Validate, score every context x format; exit status per kvtax.cli.outcome."""
    from kvtax.cli.outcome import report_outcome
    from kvtax.cli.validate import set_threads
    from kvtax.harness.quality import QualityConfig, run_quality
    from kvtax.harness.quality_report import quality_text_table
    from kvtax.harness.store import read_rows

    contexts = _check(args)
    set_threads(args.threads)
    kvs = [k.strip() for k in args.kv.split(",") if k.strip()]
    dtype = args.dtype or "float32"
    cfg = QualityConfig(
        model=args.model, contexts=contexts, kvs=kvs, tail=args.tail, text=args.text,
        baseline=args.baseline, sliding_kv=args.sliding_kv, device=args.device, dtype=dtype,
        chunk_size=args.chunk_size, command=_command(args, dtype),
    )
    run_dir = run_quality(cfg, args.out, name=args.name, resume=args.resume)
    rows = read_rows(run_dir)
    print()
    print(quality_text_table(rows))
    if not args.no_report:
        from kvtax.harness.report import write_report

        print(f"report: {write_report(run_dir)}")
    print(f"run folder: {run_dir}")
    return report_outcome(rows, "kvtax quality", "cells")
