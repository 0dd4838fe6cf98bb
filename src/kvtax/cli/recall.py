"""`kvtax recall`: planted-fact recall per KV format and context.

N facts (numbers and codes, e.g. "Marta paid exactly 4,182 copper coins for the map.") are
planted at depths spread from 0% to 100% of a filler document grown to exactly each
context (in the model's tokens); the model is asked for each fact in its own generation
(chat template applied when the tokenizer has one, greedy, stopping at the end of the
answer's line) and graded by the planted value: digit separators normalised (4,182 ==
4182), codes case-insensitive, never by filler words, a wrong or longer number is wrong.
Rows (kind "recall") go to a new run folder; a report (report.md) is written at the end.

Examples:
  kvtax recall --model tiny --contexts 512 --facts 4           # smoke test, random weights
  kvtax recall --model SmolLM2-135M-Instruct.Q4_1.gguf --contexts 1024,2048 --kv fp16,int8,int4
  kvtax recall --engine llama.cpp --model SmolLM2-135M-Instruct.Q4_1.gguf --contexts 1024 \\
      --kv f16,q8_0,q4_0
  kvtax recall --resume runs/20260101T000000Z-recall           # finish an interrupted run
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

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
        "recall",
        help="planted-fact recall per KV format and context (graded by the planted value)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny",
                   help="built-in config name (random weights), HF folder, .gguf file or hub id "
                        "(default tiny)")
    p.add_argument("--contexts", default="1024,2048",
                   help="comma-separated prompt lengths in tokens, exact, k = 1024 (default "
                        "1024,2048); one too short for the frame and facts is refused with "
                        "the minimum")
    add_allow_long(p)
    p.add_argument("--kv", default=None,
                   help="comma-separated arms, FORMAT[@s<S>r<R>][:L<i>=FORMAT...][/PATH] "
                        "(kvtax.harness.kv_arm); the unquantized one runs first. kvtax "
                        "engine: every cache on the fused path, incl. fp16 sinks/recent "
                        "(int4-g32+hk+ck@s4r128) and per-layer formats (int8+hk+ck:L0=fp16). "
                        "hf engine: 'native' is transformers' own cache, FORMAT is kvtax's "
                        "cache through the adapter, FORMAT/hf-quantized is transformers' "
                        "QuantizedCache (default fp16,int8,int4; another engine: its own "
                        "names, KV or KV/PATH, default the engine's)")
    p.add_argument("--facts", type=at_least(1), default=8, help="facts planted per prompt (default 8)")
    p.add_argument("--seed", type=int, default=0, help="fact values and subjects (default 0)")
    p.add_argument("--filler", default=None,
                   help="text file of filler paragraphs (default: the prose of CPython's "
                        "pydoc_data/topics.py; a topics.py file: that Python's prose)")
    add_engine(p, default="auto",
               extra="; kvtax: the runner, every KV format; hf: transformers' own cache; "
                     "auto: kvtax when it can load the model, else hf; another engine runs "
                     "its own --kv names, KV or KV/PATH")
    add_model_dtype(p)
    p.add_argument("--chunk-size", type=at_least(1), default=2048, help="prefill chunk in tokens "
                   "(default 2048)")
    p.add_argument("--sliding-kv", default=None,
                   help="KV format of sliding-window layers of the quantized arms (default: "
                        "the arm's own; fp16 / bf16 / fp32 arms stay unquantized everywhere)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=None,
                   help="generation budget per answer (default: the fact's sentence + 8 tokens)")
    p.add_argument("--no-chat", action="store_true",
                   help="do not apply the chat template (base models: 'Answer:' prompt)")
    add_threads(p)
    add_run_folder(p, "recall", "questions")
    p.set_defaults(func=run)


def _command(args: argparse.Namespace, dtype: str) -> str:
    """The command line that reproduces this run, every default spelled out."""
    words = ["kvtax", "recall", "--model", args.model, "--contexts", args.contexts,
             "--kv", args.kv, "--facts", str(args.facts), "--seed", str(args.seed),
             "--engine", args.engine, "--device", args.device, "--dtype", dtype,
             "--chunk-size", str(args.chunk_size)]
    for flag, value in (("--filler", args.filler), ("--sliding-kv", args.sliding_kv),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value is not None:
            words += [flag, str(value)]
    if args.no_chat:
        words.append("--no-chat")
    words += [w for u in args.url for w in ("--url", u)]
    words += [w for o in args.engine_option for w in ("--engine-option", o)]
    return shlex.join(words)


KVTAX_ENGINES = ("auto", "kvtax", "hf")  # recall.models' own loaders


def _engine_arms(engine: str, kv_text: str | None) -> list[str]:
    """Another engine's arms (its defaults when --kv is not given); refuses (one line) a
    missing engine package or an arm the engine does not know, before any folder is made."""
    from kvtax.harness.engines import require_engine
    from kvtax.harness.kv_arm import parse_arms

    cls = require_engine(engine)
    arms = parse_arms(kv_text)
    for arm in arms:
        cls.arms([arm.cache], [arm.path or cls.default_paths()[0]])
    return [a.name for a in arms] or cls.default_kvs()


def _check(args: argparse.Namespace) -> None:
    """Everything that can be refused before a model loads or a run folder is made."""
    from kvtax.cli.validate import check_arms, check_contexts, check_model, parse_contexts
    from kvtax.harness.recall.probe import RESUME_KEYS
    from kvtax.harness.store import RunStore

    if args.resume:
        stored = RunStore.open(args.resume, kind="recall", required=RESUME_KEYS).config()
        if stored.get("engine", "auto") != "openai":
            check_model(stored["model"])
        return
    try:
        contexts = parse_contexts(args.contexts)
    except argparse.ArgumentTypeError as exc:
        raise OptionError(f"--contexts: {exc}") from None
    args.contexts = ",".join(str(c) for c in contexts)
    if args.engine in KVTAX_ENGINES:
        args.kv = ",".join(check_arms(args.kv or "fp16,int8,int4", allow=("native",)))
    else:  # a missing engine package or an arm the engine does not know: one line
        args.kv = ",".join(_engine_arms(args.engine, args.kv))
    if args.filler is not None and not Path(args.filler).is_file():
        raise OptionError(f"--filler {args.filler}: no such file")
    if args.engine != "openai":  # a server's model is the server's business
        check_contexts(contexts, check_model(args.model), args.allow_long_context)


def run(args: argparse.Namespace) -> int:
    """Validate, ask every question, print the grid; exit status per kvtax.cli.outcome."""
    from kvtax.cli.outcome import report_outcome
    from kvtax.cli.validate import set_threads
    from kvtax.harness.kv_arm import parse_arm
    from kvtax.harness.recall.probe import RecallConfig, run_recall
    from kvtax.harness.report.data import recall_tables
    from kvtax.harness.store import read_rows

    _check(args)
    set_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    options = engine_options(args) if args.engine not in KVTAX_ENGINES else {}
    args.kv = args.kv or "fp16,int8,int4"  # --resume: the run folder's own arms apply
    kvs = [k.strip() for k in args.kv.split(",") if k.strip()]
    if not args.resume and args.engine == "hf" and not all(
            parse_arm(k).is_plain for k in kvs):
        raise OptionError("fp16 sinks/recent (@s<S>r<R>) and per-layer formats "
                          "(:L<i>=FORMAT) need the kvtax engine, not --engine hf")
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    cfg = RecallConfig(
        model=args.model, contexts=contexts, kvs=kvs, facts=args.facts, seed=args.seed,
        filler=args.filler, engine=args.engine, device=args.device, dtype=dtype,
        chunk_size=args.chunk_size, sliding_kv=args.sliding_kv,
        max_new_tokens=args.max_new_tokens, chat=not args.no_chat,
        command=_command(args, dtype), engine_options=options,
    )
    run_dir = run_recall(cfg, args.out, name=args.name, resume=args.resume)
    grid = recall_tables(read_rows(run_dir))["grid"]
    ctxs = sorted({c for per in grid.values() for c in per})
    print("\nrecall (correct/asked)")
    print(f"{'arm':<22}" + "".join(f"{c:>10}" for c in ctxs))
    for arm, per in grid.items():
        cells = [f"{per[c][0]}/{per[c][1]}" if c in per else "-" for c in ctxs]
        print(f"{arm:<22}" + "".join(f"{x:>10}" for x in cells))
    if not args.no_report:
        from kvtax.harness.report.write import write_report

        print(f"report: {write_report(run_dir)}")
    print(f"run folder: {run_dir}")
    return report_outcome(read_rows(run_dir), "kvtax recall", "questions")
