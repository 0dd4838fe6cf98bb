"""Hybrid KV specs (`int4+hk@s4r128`) in the runner and the recall probe.

The runner knows plain specs only; until it builds hybrid caches itself, this module
bridges, and `kvtax recall` hands the arms that need it to `run_hybrid_recall`.
`HybridRunner` is a Runner whose caches come from
`kvtax.harness.quality.probe.build_caches` (hybrid where the spec says so) and whose layers
read them through `hybrid_attention` while it runs (set on entry, restored on exit).
`HybridRecallModel` hands recall sessions such a runner for hybrid arms.

Command line, the same options as `kvtax recall`; arms may also keep listed layers in
another format (`int8+hk/L0:fp16`, kvtax.harness.quality.probe.split_layer_formats):
  python -m kvtax.harness.recall.hybrid_runner --model SmolLM2-135M-Instruct.Q4_1.gguf \\
      --contexts 1024,2048 --kv fp16,int4+hk@s4r128,int8+hk/L0:fp16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvtax.attention.hybrid import hybrid_attention
from kvtax.formats.hybrid import HybridSpec, parse_kv
from kvtax.harness.recall.models import RecallModel, Session
from kvtax.models import Runner
from kvtax.models.decoder import DecoderModel

PROG = "python -m kvtax.harness.recall.hybrid_runner"


@contextlib.contextmanager
def hybrid_attention_installed(model: DecoderModel) -> Iterator[None]:
    """Every layer's attention reads hybrid views too while inside; restored after."""
    saved = [layer.attn.attn_fn for layer in model.layers]
    try:
        for layer in model.layers:
            layer.attn.attn_fn = hybrid_attention
        yield
    finally:
        for layer, fn in zip(model.layers, saved):
            layer.attn.attn_fn = fn


class HybridRunner(Runner):
    """A Runner over hybrid caches (eager decode: CUDA graphs need a single storage).

    Example: `HybridRunner(model, "int4+hk@s4r128").generate(ids, 32)`.
    """

    def __init__(self, model: DecoderModel, kv: str, *, sliding_kv: str | None = None,
                 chunk_size: int = 2048) -> None:
        from kvtax.harness.quality.probe import split_layer_formats

        spec = parse_kv(split_layer_formats(kv)[0])  # `FMT/L0:fp16`: per-layer formats
        base = spec.base if isinstance(spec, HybridSpec) else spec
        super().__init__(model, kv=base, sliding_kv=sliding_kv, chunk_size=chunk_size,
                         cuda_graph=False)
        self.kv_name, self.sliding_name = kv, sliding_kv

    def make_caches(self, capacity: int | None = None) -> list[Any]:
        from kvtax.harness.quality.probe import build_caches

        chunk = self.chunk_size if capacity is None else min(self.chunk_size, capacity)
        return build_caches(self.model.config.layer_windows(), self.kv_name, self.sliding_name,
                            chunk)

    def prefill(self, input_ids: torch.Tensor, caches: Sequence[Any]) -> torch.Tensor:
        with hybrid_attention_installed(self.model):
            return super().prefill(input_ids, caches)

    def decode_step(self, token_ids: torch.Tensor, caches: Sequence[Any]) -> torch.Tensor:
        with hybrid_attention_installed(self.model):
            return super().decode_step(token_ids, caches)


class _HybridSession(Session):
    """A recall session whose runner builds hybrid caches (or per-layer formats)."""

    def __init__(self, model: RecallModel, kv: str, path: str, prefix: list[int],
                 capacity: int):
        from kvtax.harness.quality.probe import split_layer_formats

        spec = parse_kv(split_layer_formats(kv)[0])
        base = spec.base if isinstance(spec, HybridSpec) else spec
        super().__init__(model, base.name, path, prefix, capacity)
        self.kv = kv
        self.runner = HybridRunner(model.model, kv, sliding_kv=model.sliding_kv,
                                   chunk_size=model.chunk_size)


@dataclasses.dataclass
class HybridRecallModel(RecallModel):
    """A RecallModel (kvtax engine) that also answers on hybrid arms."""

    @classmethod
    def wrap(cls, model: RecallModel) -> "HybridRecallModel":
        return cls(**{f.name: getattr(model, f.name) for f in dataclasses.fields(model)})

    def session(self, kv: str, path: str, prefix: list[int], capacity: int) -> Session:
        if "/" in kv or isinstance(parse_kv(kv), HybridSpec):  # hybrid, or per-layer formats
            if self.engine != "kvtax":
                raise ValueError("hybrid KV specs and per-layer formats need the kvtax engine")
            return _HybridSession(self, kv, path, prefix, capacity)
        return super().session(kv, path, prefix, capacity)


def main(argv: list[str] | None = None) -> int:
    """`kvtax recall` with hybrid arms allowed; the same options, the same run folders."""
    from kvtax.cli import recall as recall_cli

    parser = argparse.ArgumentParser(prog=PROG, add_help=False)
    recall_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["recall", *(sys.argv[1:] if argv is None else argv)])
    return run_hybrid_recall(args, PROG)


def needs_hybrid(kv: str) -> bool:
    """True for a recall arm only this module serves: a hybrid spec (`@s4r128`) or
    per-layer formats (`int8+hk/L0:fp16`), as opposed to `FORMAT[/PATH]`."""
    return "@" in kv or bool(re.search(r"/L\d+:", kv))


def run_hybrid_recall(args: argparse.Namespace, prog: str = "kvtax recall") -> int:
    """Run the recall probe for parsed `kvtax recall` arguments through hybrid-aware
    sessions (`kvtax recall` hands over here when an arm needs it)."""
    from kvtax.cli import recall as recall_cli
    from kvtax.harness.recall.probe import RecallConfig, run_recall
    from kvtax.harness.recall.models import load_recall_model

    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    kvs = [k.strip() for k in args.kv.split(",") if k.strip()]
    for kv in kvs:
        parse_kv(kv.split("/")[0])  # FormatError names the valid formats
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.engine = "kvtax"  # hybrid caches live in the kvtax runner only
    command = recall_cli._command(args, dtype)
    command = prog + command[len("kvtax recall"):]
    cfg = RecallConfig(
        model=args.model, contexts=contexts, kvs=kvs, facts=args.facts, seed=args.seed,
        filler=args.filler, engine="kvtax", device=args.device, dtype=dtype,
        chunk_size=args.chunk_size, sliding_kv=args.sliding_kv,
        max_new_tokens=args.max_new_tokens, chat=not args.no_chat, command=command,
    )
    model = HybridRecallModel.wrap(load_recall_model(
        args.model, engine="kvtax", dtype=dtype, device=args.device,
        chunk_size=args.chunk_size, sliding_kv=args.sliding_kv, seed=args.seed))
    run_dir = run_recall(cfg, args.out, name=args.name, resume=args.resume, model=model)
    if not args.no_report:
        from kvtax.harness.report.write import write_report

        print(f"report: {write_report(run_dir)}")
    print(f"run folder: {run_dir}")
    from kvtax.cli.outcome import report_outcome
    from kvtax.harness.store import read_rows

    return report_outcome(read_rows(run_dir), prog, "questions")


if __name__ == "__main__":
    raise SystemExit(main())
