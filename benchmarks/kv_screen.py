"""Screen K/V quantization schemes on a real model by fake quantization, before any kernel.

    python benchmarks/kv_screen.py --model /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --contexts 2048 --schemes int4,k4c32/v4g32@s4r128 --out runs/screen

For each context c the first c + 1 tokens of the usual text (the prose of CPython's
`pydoc_data/topics.py`, as `kvtax quality` reads it) run teacher-forced in ONE forward of
the transformers model, whose attention fake-quantizes K and V (quantize → dequantize,
`kv_quant_sim.py`; attention itself is transformers' SDPA, unchanged). `+pre` schemes
quantize keys before RoPE and rotate the dequantized keys. Per scheme and context, over the
last `--tail` positions against the fp16 run (K/V rounded to fp16 only): KL(fp16 ‖ scheme)
mean ± s.e., top-1 agreement, Δppl (`kvtax.harness.quality.metrics`), each layer's relative
attention-output error on the tail queries (the same q over the layer's own fp16 K/V, so
not error carried in from earlier layers), and the bytes a real cache holds relative to fp16
(at c and at 32k), scales/zeros/windows included.

Approximation: a recent window of R keys *per query* does not fit one forward, so the last
R + tail positions of the sequence stay fp16 (every scored query sees >= R fp16 recent
keys; the bytes count R). Per-channel blocks are cut on the final length: a scored query
may see keys of its own block quantized that a real cache would still hold in fp16.

Output: one line per row on stdout, `rows.jsonl` (appended as rows finish), `table.md`
and `command.txt` in --out.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_quant_sim  # noqa: E402
from kv_quant_sim import SchemeError, bytes_ratio, fake_quant, parse_scheme  # noqa: E402

from kvtax.harness.quality.metrics import kl_divergence, log_probs, nll, top1_agree  # noqa: E402

DEFAULT_SCHEMES = ",".join([
    "int4", "int4-g32+hk+ck@s4r128",
    "k4c32/v4g32", "k4c64/v4g32", "k4c128/v4g32",
    "k4c32/v4g32@s4r128", "k4c64/v4g32@s4r128", "k4c128/v4g32@s4r128",
    "k4c32+pre/v4g32@s4r128", "k4c64+pre/v4g32@s4r128",
])


class Screen:
    """Per-forward state the attention hook reads: the scheme, the scored tail, the stashed
    unquantized keys of a `+pre` scheme, and per-layer squared errors."""

    def __init__(self) -> None:
        self.scheme = parse_scheme("fp16")
        self.tail = 128
        self.k_ref: torch.Tensor | None = None
        self.err2: dict[int, float] = {}
        self.ref2: dict[int, float] = {}

    def start(self, scheme: Any, tail: int) -> None:
        self.scheme, self.tail, self.err2, self.ref2 = scheme, tail, {}, {}

    def keep_recent(self) -> int:
        s = self.scheme
        return s.recent + self.tail if s.recent else 0

    def quant_k(self, k: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        return fake_quant(k, s.k, sinks=s.sinks, keep_recent=self.keep_recent()).to(k.dtype)

    def quant_v(self, v: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        return fake_quant(v, s.v, sinks=s.sinks, keep_recent=self.keep_recent()).to(v.dtype)

    def layer_errors(self) -> list[float]:
        return [math.sqrt(self.err2[i] / max(self.ref2[i], 1e-30)) for i in sorted(self.err2)]


SCREEN = Screen()


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, **kw: Any) -> tuple[torch.Tensor, None]:
    """The attention interface: q `[B, Hq, T, D]`, k/v `[B, Hkv, T, D]` post-RoPE; K/V
    fake-quantized, then transformers' SDPA; the tail's error against fp16 K/V recorded."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pre = SCREEN.scheme.k is not None and SCREEN.scheme.k.pre_rope
    k_ref = SCREEN.k_ref if pre else key
    k_q = key if pre else SCREEN.quant_k(key)  # +pre keys were quantized before RoPE
    v_q = SCREEN.quant_v(value)
    out, _ = sdpa_attention_forward(module, query, k_q, v_q, attention_mask, **kw)
    m = min(SCREEN.tail, query.shape[2])
    t = key.shape[2]
    rows = torch.arange(t - m, t).view(-1, 1) >= torch.arange(t).view(1, -1)
    ref, _ = sdpa_attention_forward(module, query[:, :, -m:], k_ref.half().to(key.dtype),
                                    value.half().to(value.dtype), rows.view(1, 1, m, t),
                                    **{**kw, "is_causal": False})
    i = module.layer_idx
    diff = out[:, -m:].float() - ref.float()
    SCREEN.err2[i] = SCREEN.err2.get(i, 0.0) + float(diff.pow(2).sum())
    SCREEN.ref2[i] = SCREEN.ref2.get(i, 0.0) + float(ref.float().pow(2).sum())
    return out, None


def _pre_rope(orig: Any) -> Any:
    """Wrap a model's `apply_rotary_pos_emb(q, k, cos, sin, ...)`: with a `+pre` scheme the
    keys are fake-quantized before rotation; the unquantized rotated keys are stashed."""

    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              *a: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        s = SCREEN.scheme
        if s.k is None or not s.k.pre_rope:
            return orig(q, k, cos, sin, *a, **kw)
        q_rot, k_rot = orig(q, SCREEN.quant_k(k), cos, sin, *a, **kw)
        SCREEN.k_ref = orig(q[:, :1], k, cos, sin, *a, **kw)[1]
        return q_rot, k_rot

    return apply


def install_hooks(model: Any) -> None:
    """Route the model's attention through `_attention` and its RoPE through `_pre_rope`."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register("kv_screen", _attention)
    AttentionMaskInterface.register("kv_screen", sdpa_mask)
    model.set_attn_implementation("kv_screen")
    mod = sys.modules[type(model.model.layers[0].self_attn).__module__]
    if not hasattr(mod, "apply_rotary_pos_emb"):
        raise RuntimeError(f"{mod.__name__} has no apply_rotary_pos_emb to hook (+pre)")
    mod.apply_rotary_pos_emb = _pre_rope(mod.apply_rotary_pos_emb)


def load(model: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """(transformers model, tokenizer-like with encode/prefix_ids). `tiny`: a random
    2-layer Llama (vocab 1024, attention made peaky by a larger init) over UTF-8 bytes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model == "tiny":
        from kvtax.hf.models import tiny_config

        torch.manual_seed(0)
        cfg = tiny_config("llama", vocab=1024, initializer_range=0.2,
                          max_position_embeddings=4096)
        net = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        return net, _ByteTok()
    from kvtax.harness.text import HFTextTokenizer

    path = Path(model).expanduser()
    where, extra = (str(path.parent), {"gguf_file": path.name}) if path.suffix == ".gguf" \
        else (model, {})
    tok = AutoTokenizer.from_pretrained(where, **extra)
    net = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **extra).eval()
    return net, HFTextTokenizer(tok)


class _ByteTok:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def prefix_ids(self) -> list[int]:
        return []


@torch.no_grad()
def forward_tail(net: Any, ids: torch.Tensor, tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher-forced forward of `ids` `[1, c + 1]`: log-probs `[tail, V]` of the last
    `tail` inputs and the NLL `[tail]` of their real next tokens."""
    c = ids.shape[1] - 1
    logits = net(input_ids=ids[:, :c], logits_to_keep=tail, use_cache=False).logits[0]
    return log_probs(logits), nll(logits, ids[0, c - tail + 1:])


def run_row(net: Any, ids: torch.Tensor, scheme: Any, tail: int, base: dict[str, Any] | None,
            head_dim: int) -> tuple[dict[str, Any], torch.Tensor]:
    """One scheme × context: the row's numbers (against `base`, the fp16 row's) and its
    tail log-probs."""
    t0 = time.perf_counter()
    SCREEN.start(scheme, tail)
    logp, tok_nll = forward_tail(net, ids, tail)
    c = ids.shape[1] - 1
    row: dict[str, Any] = {"scheme": scheme.name, "context": c, "tail": tail,
                           "ppl": math.exp(float(tok_nll.mean()))}
    errs = SCREEN.layer_errors()
    worst = max(range(len(errs)), key=errs.__getitem__)
    row.update(layer_attn_rel_err=errs, worst_layer=worst, worst_err=errs[worst],
               bytes_ratio=bytes_ratio(scheme, c, head_dim),
               bytes_ratio_32k=bytes_ratio(scheme, 32768, head_dim))
    if base is not None:
        kl = kl_divergence(base["logp"], logp)
        row.update(kl=float(kl.mean()), kl_sem=float(kl.std() / math.sqrt(len(kl))),
                   kl_max=float(kl.max()), top1=float(top1_agree(base["logp"], logp)
                                                      .double().mean()),
                   ppl_base=base["ppl"], ppl_delta=row["ppl"] - base["ppl"])
    row["seconds"] = time.perf_counter() - t0
    return row, logp


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the rows (fp16 rows omitted)."""
    out = ["| scheme | context | KL ± s.e. | top-1 | Δppl | worst layer (attn err) | "
           "bytes @ctx | bytes @32k |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        if "kl" not in r:
            continue
        out.append(f"| `{r['scheme']}` | {r['context']} | {r['kl']:.3g} ± {r['kl_sem']:.2g} | "
                   f"{r['top1']:.3f} | {r['ppl_delta']:+.3g} | L{r['worst_layer']} "
                   f"{100 * r['worst_err']:.0f}% | {r['bytes_ratio']:.3f} | "
                   f"{r['bytes_ratio_32k']:.3f} |")
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny",
                   help="`tiny` (random 2-layer Llama), an HF folder or a .gguf file (default tiny)")
    p.add_argument("--contexts", default="2048",
                   help="comma-separated context lengths in tokens (default 2048)")
    p.add_argument("--schemes", default=DEFAULT_SCHEMES,
                   help="comma-separated schemes, grammar in kv_quant_sim.py "
                        "(k<bits><g|c><size>[+h][+ck][+pre]/v<bits>g<size>[@s<S>r<R>]); "
                        f"default {DEFAULT_SCHEMES}")
    p.add_argument("--tail", type=int, default=128, help="scored last positions (default 128)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--meta-dtype", choices=("float16", "float32"), default="float16",
                   help="dtype scales/zeros are stored in (default float16; bytes assume fp16)")
    p.add_argument("--out", default=None, help="folder for rows.jsonl, table.md, command.txt")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
        schemes = [parse_scheme(s) for s in args.schemes.split(",") if s]
    except (ValueError, SchemeError) as exc:
        print(f"kv_screen: {exc}", file=sys.stderr)
        return 2
    if args.tail < 1 or min(contexts) <= args.tail:
        print(f"kv_screen: --tail {args.tail} must be >= 1 and below every context",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    kv_quant_sim.META_DTYPE = getattr(torch, args.meta_dtype)
    from kvtax.harness.quality.probe import text_ids, text_of

    net, tok = load(args.model, torch.float32)
    install_hooks(net)
    head_dim = getattr(net.config, "head_dim", None) or \
        net.config.hidden_size // net.config.num_attention_heads
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "command.txt").write_text(
            "python " + " ".join(map(shlex.quote, sys.argv)) + "\n"
            f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {platform.node()} "
            f"torch {torch.__version__}, {args.threads} threads\n")
    rows: list[dict[str, Any]] = []
    for c in contexts:
        ids = torch.tensor([text_ids(tok, text_of(None), c + 1)])
        base_row, base_logp = run_row(net, ids, parse_scheme("fp16"), args.tail, None, head_dim)
        base = {"logp": base_logp, "ppl": base_row["ppl"]}
        for s in [None, *schemes]:
            row = base_row if s is None else run_row(net, ids, s, args.tail, base, head_dim)[0]
            row.update(model=args.model, meta_dtype=args.meta_dtype)
            rows.append(row)
            print(_line(row), flush=True)
            if out:
                with open(out / "rows.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
    text = table(rows)
    print(text)
    if out:
        (out / "table.md").write_text(text + "\n")
    return 0


def _line(r: dict[str, Any]) -> str:
    if "kl" not in r:
        return f"== fp16 @ {r['context']}: ppl {r['ppl']:.4g} [{r['seconds']:.1f} s]"
    return (f"== {r['scheme']} @ {r['context']}: KL {r['kl']:.3g} ± {r['kl_sem']:.2g}, "
            f"top-1 {r['top1']:.3f}, dppl {r['ppl_delta']:+.3g}, worst L{r['worst_layer']} "
            f"{r['worst_err']:.3g}, bytes {r['bytes_ratio']:.3f} (32k {r['bytes_ratio_32k']:.3f})"
            f" [{r['seconds']:.1f} s]")


if __name__ == "__main__":
    sys.exit(main())
