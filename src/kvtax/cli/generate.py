"""`kvtax generate`: run a model over a quantized KV cache, stream the text, print the costs.

--model is a built-in config name (random weights, byte tokenizer: runs offline in
seconds; the text is noise), a Hugging Face checkpoint folder, a .gguf file (converted once
to a cached folder) or a hub id. After the text it prints time to first token, prefill and
decode tokens/s, peak memory (CUDA: peak allocated; CPU: process peak RSS) and the KV
cache's resident bytes.

Examples:
  kvtax generate --model tiny --max-tokens 16
  kvtax generate --model SmolLM2-135M-Instruct.Q4_1.gguf --chat --threads 1 \\
      --prompt "What is a KV cache?"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvtax.cli.options import add_allow_long, add_threads
from kvtax.cli.validate import at_least
from kvtax.errors import OptionError
from kvtax.formats import DEFAULT_KV
from kvtax.harness.dtypes import DTYPES, torch_dtype


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text over a quantized KV cache and report TTFT, tok/s, memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None,
                   help="built-in config (tiny, llama-3.1-8b, ...), HF folder, .gguf file or "
                        "hub id (default tiny)")
    # The model as a positional word: accepted for one release, with a notice on stderr.
    p.add_argument("model_word", nargs="?", default=None, help=argparse.SUPPRESS)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="The key-value cache", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--kv", default=None, help="KV cache: fp16, int8, int4, fp8, k8v4, "
                   f"int4-g32, int8+hk+ck, ... (default {DEFAULT_KV}, or int8+hk for a "
                   "model that soft-caps attention logits: see docs/QUALITY.md); "
                   "FORMAT@s<S>r<R> keeps S sink and R recent tokens in fp16 (eager decode), "
                   "FORMAT:L<i>=FORMAT another format in layer i (kvtax.harness.kv_arm)")
    p.add_argument("--sliding-kv", default=None,
                   help="format of sliding-window layers, e.g. fp16 (default: same as --kv)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as one user message in the tokenizer's chat template "
                        "(with the assistant's generation prompt)")
    p.add_argument("--max-tokens", type=at_least(1), default=64,
                   help="new tokens at most (default 64)")
    add_allow_long(p)
    p.add_argument("--chunk-size", type=at_least(1), default=2048,
                   help="prefill chunk in tokens (default 2048)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling and random-weight seed")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    p.add_argument("--no-cuda-graph", action="store_true", help="eager decode on CUDA")
    p.add_argument("--no-fused-gemv", action="store_true",
                   help="decode linear layers with torch (F.linear + separate norms) instead "
                        "of kvtax's fused Triton GEMVs (the default on CUDA where they apply)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the CUDA-graph decode step (fewer, fused kernels; "
                        "a one-time compile before the first decode step)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weight dtype (default bf16 on CUDA, fp32 on CPU)")
    add_threads(p)
    p.set_defaults(func=run)


def _model(args: argparse.Namespace) -> str:
    """--model, or the deprecated positional model word (with a notice)."""
    if args.model_word is not None:
        if args.model is not None and args.model != args.model_word:
            raise OptionError(f"two models given: --model {args.model} and {args.model_word}")
        print(f"kvtax generate: the positional model is deprecated; use --model "
              f"{args.model_word}", file=sys.stderr)
        return args.model_word
    return args.model or "tiny"


def _prompt_ids(tok, prompt: str, chat: bool) -> list[int]:  # noqa: ANN001
    """The prompt's ids; with `chat`, rendered through the tokenizer's chat template."""
    if not chat:
        return tok.encode(prompt)
    hf = getattr(tok, "tok", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise OptionError("--chat: this model's tokenizer has no chat template")
    text = hf.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                  add_generation_prompt=True)
    return list(hf.encode(text, add_special_tokens=False))  # the template holds BOS


def _cache(text: str | None) -> tuple[str | None, dict[int, str] | None]:
    """(format, layer overrides) of `--kv` (one cache of the kv_arm grammar, no path)."""
    from kvtax.cli.validate import check_arms
    from kvtax.harness.kv_arm import parse_arm

    if text is None:
        return None, None
    arms = check_arms(text)
    arm = parse_arm(arms[0])
    if len(arms) > 1 or arm.path:
        raise OptionError(f"--kv {text}: one cache, FORMAT[@s<S>r<R>][:L<i>=FORMAT], no list "
                          "or /PATH")
    return arm.base, arm.layers or None


def run(args: argparse.Namespace) -> int:
    from kvtax.cli.validate import check_formats, set_threads
    from kvtax.models import Runner, load_model, load_tokenizer, locate

    model_name = _model(args)
    locate(model_name)  # a missing model: one line, before anything prints
    kv, overrides = _cache(args.kv)
    if args.sliding_kv is not None:
        check_formats([args.sliding_kv], "--sliding-kv", hybrid=True)
    set_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch_dtype(args.dtype or ("bf16" if device.startswith("cuda") else "fp32"))
    prompt = args.prompt_file.read_text() if args.prompt_file else args.prompt
    print(f"loading {model_name} ({dtype}, {device})", file=sys.stderr)
    model = load_model(model_name, dtype=dtype, device=device, seed=args.seed)
    tok = load_tokenizer(model)
    ids = _prompt_ids(tok, prompt, args.chat)
    limit = model.config.max_position_embeddings
    if len(ids) + args.max_tokens > limit and not args.allow_long_context:
        raise OptionError(f"prompt {len(ids)} + --max-tokens {args.max_tokens} tokens is past "
                          f"the model's maximum of {limit} positions; pass "
                          "--allow-long-context to run past it")
    runner = Runner(
        model, kv=kv, overrides=overrides, sliding_kv=args.sliding_kv,
        chunk_size=args.chunk_size,
        cuda_graph=False if args.no_cuda_graph else None, compile=args.compile,
        fused_gemv=False if args.no_fused_gemv else None,
    )
    stream = _Streamer(tok)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    eos = tok.eos_token_id if tok.eos_token_id is not None else None
    result = runner.generate(
        torch.tensor([ids]), args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        ignore_eos=args.ignore_eos, eos_token_id=eos, on_token=stream, seed=args.seed,
    )
    stream.flush()
    print()
    mode = "cuda graph" if result.cuda_graph else "eager"
    print(f"\nprompt {result.prompt_tokens} tokens, generated {len(result.tokens)} "
          f"(kv {runner.spec.name}, decode {mode})")
    print(f"TTFT                 {result.ttft_s * 1000:10.1f} ms")
    print(f"prefill              {result.prefill_tokens_per_s:10.1f} tok/s")
    print(f"decode               {result.decode_tokens_per_s:10.1f} tok/s "
          f"({result.decode_ms_per_token:.2f} ms/token)")
    print(f"peak memory          {_mib(result.peak_bytes)}")
    print(f"KV cache (resident)  {_mib(result.cache_bytes)} allocated, "
          f"{_mib(result.cache_used_bytes)} in use")
    return 0


class _Streamer:
    """Prints text as tokens arrive, holding back bytes until they decode cleanly."""

    def __init__(self, tok) -> None:  # noqa: ANN001
        self.tok, self.ids, self.printed = tok, [], ""

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more
            self._emit(text)

    def flush(self) -> None:
        self._emit(self.tok.decode(self.ids))

    def _emit(self, text: str) -> None:
        new = text[len(self.printed):] if text.startswith(self.printed) else text
        self.printed = text
        sys.stdout.write(new)
        sys.stdout.flush()


def _mib(n: int) -> str:
    return f"{n / 2**20:10.2f} MiB"
