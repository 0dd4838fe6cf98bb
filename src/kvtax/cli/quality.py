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
keys in fp16 and reads the rest from int4 (a trailing i8, int4+hk@s4r128i8, keeps them in
int8). Short names: q8, q4, q3 (docs/QUALITY.md).

Rows (kind "quality") go to a new run folder; `kvtax report RUN` renders the tables.

--engine NAME (transformers, llama.cpp, mlx-lm, ...) scores that engine's cache settings
(--kv, and --paths) against the same engine's unquantized arm on the same text: KL, top-1
and perplexity from the engine's own logits; per-layer attention error is kvtax's alone.

Examples:
  kvtax quality --model tiny --contexts 256 --kv int8,int4          # smoke test, random weights
  kvtax quality --model SmolLM2-135M-Instruct.Q4_1.gguf --contexts 512,2048 \\
      --kv int8,int4,int4+hk,int4+hkv,int4+hk@s4r128,k8v4
  kvtax quality --engine llama.cpp --model SmolLM2-135M-Instruct.Q4_1.gguf --contexts 512 \\
      --kv f16,q8_0,q4_0 --tail 64
  kvtax quality --resume runs/20260101T000000Z-quality             # finish an interrupted run
"""

from __future__ import annotations

import argparse
import shlex

from typing import Any

from kvtax.cli.options import (
    add_allow_long,
    add_engine,
    add_model_dtype,
    add_run_folder,
    add_threads,
    engine_options,
)
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
    p.add_argument("--kv", default=None,
                   help="comma-separated KV formats compared with the baseline (default "
                        "int8,int8+hk,int4,int4+hk); the arm grammar of kvtax.harness.kv_arm: "
                        "FORMAT@s<S>r<R> keeps S sink and R recent tokens in fp16 (@s<S>r<R>i8: "
                        "in int8), "
                        "FORMAT:L0=fp16:L8=int8 keeps the listed layers in another format; "
                        "another engine's own cache settings (default: the engine's)")
    add_engine(p)
    p.add_argument("--paths", default=None,
                   help="another engine's attention paths, comma-separated (default: the "
                        "engine's, e.g. llama.cpp fa)")
    p.add_argument("--tail", type=at_least(1), default=128,
                   help="scored positions: the last N of each context (default 128)")
    p.add_argument("--text", default=None,
                   help="text file to score (default: the prose of CPython's "
                        "pydoc_data/topics.py; a topics.py file: that Python's prose)")
    p.add_argument("--baseline", default=None,
                   help="KV format of the reference run (default fp16; another engine: its "
                        "unquantized arm)")
    p.add_argument("--sliding-kv", default=None,
                   help="KV format of sliding-window layers of the quantized arms (default: "
                        "the arm's own; fp16 / bf16 / fp32 arms stay unquantized everywhere)")
    # float32 on CUDA too: a bf16 model amplifies any perturbation of the cache, so KL
    # against a bf16 run reads 2-4x higher than the cache's own error (Qwen2.5-Coder-0.5B
    # int8+hk+ck at 32k: 1.7e-3 bf16 vs 5.1e-4 float32, docs/QUALITY.md).
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
             "--kv", args.kv, "--tail", str(args.tail), "--device", args.device,
             "--dtype", dtype, "--chunk-size", str(args.chunk_size)]
    if args.engine != "kvtax":
        words += ["--engine", args.engine]
        words += [w for u in args.url for w in ("--url", u)]
        words += [w for o in args.engine_option for w in ("--engine-option", o)]
    for flag, value in (("--text", args.text), ("--sliding-kv", args.sliding_kv),
                        ("--baseline", args.baseline), ("--paths", args.paths),
                        ("--threads", args.threads)):
        if value is not None:
            words += [flag, str(value)]
    return shlex.join(words)


def check(args: argparse.Namespace) -> list[int]:
    """Contexts, formats and model, refused before a model loads; [] on --resume."""
    from kvtax.cli.validate import (
        check_arms, check_contexts, check_formats, check_model, parse_contexts,
    )
    from kvtax.harness.quality.probe import RESUME_KEYS
    from kvtax.harness.store import RunStore

    if args.resume:
        stored = RunStore.open(args.resume, kind="quality", required=RESUME_KEYS).config()
        if (stored.get("engine") or "kvtax") == "kvtax":
            check_model(stored["model"])
        return []
    try:
        contexts = parse_contexts(args.contexts)
    except argparse.ArgumentTypeError as exc:
        raise OptionError(f"--contexts: {exc}") from None
    if args.engine == "kvtax":
        args.kv = args.kv or "int8,int8+hk,int4,int4+hk"
        args.baseline = args.baseline or "fp16"
        args.kv = ",".join(check_arms(args.kv))
        check_formats([args.baseline], "--baseline")
    if args.engine != "openai":  # a server's model is the server's business
        # A context of c runs c input tokens (positions 0..c-1); the (c+1)-th token is only
        # a target, so c = the model's maximum is in range (32k on a 32k model).
        check_contexts(contexts, check_model(args.model), args.allow_long_context)
    return contexts


def run(args: argparse.Namespace) -> int:
    """Validate, score every context x format; exit status per kvtax.cli.outcome."""
    from kvtax.cli.validate import set_threads
    from kvtax.harness.quality.probe import QualityConfig, run_quality

    contexts = check(args)
    set_threads(args.threads)
    engine = _stored_engine(args.resume) if args.resume else args.engine
    if engine != "kvtax":
        return _run_engine(args, engine, contexts)
    kvs = [k.strip() for k in args.kv.split(",") if k.strip()]
    dtype = args.dtype or "float32"
    cfg = QualityConfig(
        model=args.model, contexts=contexts, kvs=kvs, tail=args.tail, text=args.text,
        baseline=args.baseline, sliding_kv=args.sliding_kv, device=args.device, dtype=dtype,
        chunk_size=args.chunk_size, command=_command(args, dtype),
    )
    run_dir = run_quality(cfg, args.out, name=args.name, resume=args.resume)
    return _finish(args, run_dir)


def _finish(args: argparse.Namespace, run_dir: Any) -> int:
    from kvtax.cli.outcome import report_outcome
    from kvtax.harness.quality.tables import quality_text_table
    from kvtax.harness.store import read_rows

    rows = read_rows(run_dir)
    print()
    print(quality_text_table(rows))
    if not args.no_report:
        from kvtax.harness.report.write import write_report

        print(f"report: {write_report(run_dir)}")
    print(f"run folder: {run_dir}")
    return report_outcome(rows, "kvtax quality", "cells")


def _stored_engine(run_dir: str) -> str:
    """The engine a run folder was made with (kvtax for runs made before engines)."""
    from kvtax.harness.store import RunStore

    return str(RunStore.open(run_dir).config().get("engine") or "kvtax")


def _run_engine(args: argparse.Namespace, engine: str, contexts: list[int]) -> int:
    """Another engine's arms against its own unquantized arm (harness.quality.engine)."""
    from dataclasses import replace

    from kvtax.harness.quality.probe import QualityInputError, check_config
    from kvtax.harness.quality.engine import run_engine_quality

    try:
        cfg, eq = _engine_config(args, engine, contexts)
        # The numeric checks (contexts, tail, chunk, text); formats are the engine's to judge.
        check_config(replace(cfg, kvs=[], baseline="fp16", sliding_kv=None))
        run_dir = run_engine_quality(cfg, eq, args.out, name=args.name, resume=args.resume)
    except (QualityInputError, FileNotFoundError) as exc:  # one line, exit 2 (kvtax.cli)
        raise OptionError(str(exc)) from None
    return _finish(args, run_dir)


def _engine_config(args: argparse.Namespace, engine: str, contexts: list[int]) -> Any:
    """(QualityConfig, EngineQuality) from the command line, or from the run folder."""
    from kvtax.harness.engines import require_engine
    from kvtax.harness.quality.probe import QualityConfig
    from kvtax.harness.quality.engine import EngineQuality
    from kvtax.harness.store import RunStore

    if args.resume:
        stored = RunStore.open(args.resume).config()
        cfg = QualityConfig(**{k: v for k, v in stored.items()
                               if k in QualityConfig.__dataclass_fields__})
        eq = EngineQuality(engine, list(stored.get("engine_paths") or []),
                           stored.get("engine_threads"), stored.get("engine_options") or {})
    else:
        cls = require_engine(engine)  # a missing package: one line naming its install
        dtype = args.dtype or "float32"
        kvs = [k.strip() for k in (args.kv or "").split(",") if k.strip()] or cls.default_kvs()
        args.kv = ",".join(kvs)
        cfg = QualityConfig(model=args.model, contexts=contexts, kvs=kvs, tail=args.tail,
                            text=args.text, baseline=args.baseline or "", device=args.device,
                            dtype=dtype, chunk_size=args.chunk_size,
                            command=_command(args, dtype))
        paths = [p.strip() for p in (args.paths or "").split(",") if p.strip()]
        eq = EngineQuality(engine, paths, args.threads, engine_options(args))
    return cfg, eq
