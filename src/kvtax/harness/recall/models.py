"""Models the recall probe can question: the kvtax runner, or a transformers model as is.

Two engines behind one `session(kv, path, prefix, capacity).ask(suffix, budget)` interface:
  - "kvtax": a DecoderModel over kvtax caches of any KV format (greedy; stops at EOS or at
    the end of the line that gives a value). A `.gguf` file is read through transformers'
    GGUF loader (weights dequantized) and converted once to a safetensors folder the kvtax
    loader reads, cached under ~/.cache/kvtax/gguf/.
  - "hf": a transformers model through `model.generate` (greedy, same stops), with its own
    cache ("native", path fp16), kvtax's cache through the transformers adapter kvtax.hf
    ("int8", path fused), or transformers' QuantizedCache ("int4/hf-quantized") when its
    backend package (optimum-quanto or hqq) is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtax.harness.dtypes import kv_name, torch_dtype
from kvtax.harness.kv_arm import parse_arm
from kvtax.harness.text import ByteTextTokenizer, HFTextTokenizer, TextTokenizer
from kvtax.models.gguf import gguf_folder  # noqa: F401 - where recall code found it



class Unavailable(RuntimeError):
    """This engine cannot run this arm here (a missing package or adapter); not a failure."""


def stop_after_line(text: str) -> bool:
    """True once the answer has a complete line holding a digit (every planted value has
    one): "4,182 coins" + newline stops, a preamble line ("The answer is:") does not."""
    lines = text.split("\n")[:-1]  # the last piece is the unfinished line
    return any(any(c.isdigit() for c in line) for line in lines)


@dataclass
class RecallModel:
    """A loaded model, its tokenizer, and how to ask it a question."""

    label: str
    engine: str                  # "kvtax" | "hf"
    model: Any
    tokenizer: TextTokenizer
    eos_ids: tuple[int, ...]
    chunk_size: int = 2048
    sliding_kv: str | None = None

    def resolve(self, arm: str) -> tuple[str, str]:
        """(kv, schema path) of an arm (`kvtax.harness.kv_arm`) or "native".

        kvtax engine: every cache (hybrid `int4+hk@s4r128`, per-layer `int8+hk:L0=fp16`)
        on the fused path. hf engine: "native" (or the model's dtype) is transformers' own
        cache (path fp16); "FORMAT" is kvtax's cache through the transformers adapter
        (path fused); "FORMAT/hf-quantized" is transformers' QuantizedCache.
        """
        parsed = parse_arm(arm)
        kv, path = parsed.cache, parsed.path or ""
        if kv == "native":
            kv = self.native_kv
        if self.engine == "kvtax":
            if path not in ("", "fused"):
                raise ValueError(f"arm {arm!r}: the kvtax engine runs the fused path only")
            return kv, "fused"
        if not parsed.is_plain:
            raise ValueError(f"arm {arm!r}: fp16 sinks/recent (@s<S>r<R>) and per-layer "
                             "formats (:L<i>=FORMAT) need the kvtax engine")
        if kv == self.native_kv and path in ("", "fp16"):
            return kv, "fp16"
        if path not in ("", "fused", "hf-quantized"):
            raise ValueError(f"arm {arm!r}: the hf engine runs fp16 (native), fused (kvtax "
                             "adapter) or hf-quantized")
        return kv, path or "fused"

    @property
    def native_kv(self) -> str:
        """The unquantized KV format this engine's baseline uses (hf: the model's dtype)."""
        if self.engine == "kvtax":
            return "fp16"
        return kv_name(next(self.model.parameters()).dtype)

    def session(self, kv: str, path: str, prefix: list[int], capacity: int) -> "Session":
        """Questions that all start with `prefix`, on one arm; see `Session`."""
        return Session(self, kv, path, prefix, capacity)

    @torch.no_grad()
    def greedy(self, runner: Any, caches: list, logits: torch.Tensor, budget: int,
               stop: Callable[[str], bool] | None = stop_after_line) -> list[int]:
        """Greedy tokens from `logits` on: stop at EOS, `budget`, or once `stop(text)`
        (default: the end of the line that gives a value, `stop_after_line`)."""
        out: list[int] = []
        while True:
            tok = int(logits[0].argmax())
            if tok in self.eos_ids:
                break
            out.append(tok)
            if len(out) >= budget or (stop is not None and stop(self.tokenizer.decode(out))):
                break
            logits = runner.decode_step(torch.tensor([[tok]]), caches)
        return out

    @torch.no_grad()
    def hf_generate(self, ids: list[int], kv: str, path: str, budget: int) -> list[int]:
        """transformers' `generate`, greedy, with the same stop rules; `path` picks the
        cache: fp16 (the model's own), fused (kvtax's, via kvtax.hf), hf-quantized."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        tokenizer, n_prompt = self.tokenizer, len(ids)

        class _LineStop(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
                done = stop_after_line(tokenizer.decode(input_ids[0, n_prompt:].tolist()))
                return torch.full((input_ids.shape[0],), done, dtype=torch.bool,
                                  device=input_ids.device)

        dev = next(self.model.parameters()).device
        x = torch.tensor([ids], device=dev)
        eos = list(self.eos_ids) or None
        common = dict(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=budget,
                      do_sample=False, stopping_criteria=StoppingCriteriaList([_LineStop()]),
                      eos_token_id=eos, pad_token_id=eos[0] if eos else None)
        if path == "fused":
            kh = _kvtax_hf()
            with kh.installed(self.model, warn_untested=False):
                cache = kh.KVTaxCache(self.model.config, kv=kv,
                                      sliding_kv=parse_arm(kv).sliding(self.sliding_kv))
                out = self.model.generate(**common, **{kh.cache_kwarg(self.model): cache})
        else:
            kwargs = _hf_quantized_kwargs(kv) if path == "hf-quantized" else {}
            out = self.model.generate(**common, **kwargs)
        return [t for t in out[0, n_prompt:].tolist() if t not in self.eos_ids]


def _kvtax_hf() -> Any:
    """The transformers adapter (kvtax.hf), or Unavailable saying why not."""
    try:
        import kvtax.hf as kh
    except ImportError as exc:
        raise Unavailable(f"the kvtax transformers adapter cannot be imported ({exc})") from exc
    return kh


class Session:
    """Several questions after one shared prefix (the recall document), one KV arm.

    kvtax engine: the prefix is prefilled once into caches of `capacity` tokens; each
    `ask` prefills its suffix, answers greedily, then trims the caches back to the prefix.
    Where a trim is impossible (a sliding-window ring that wrapped) or a question failed
    midway, the next `ask` prefills the prefix again. The hf engine runs every question
    from scratch through `generate`.
    """

    def __init__(self, model: RecallModel, kv: str, path: str, prefix: list[int],
                 capacity: int):
        self.model, self.kv, self.path = model, kv, path
        self.prefix, self.capacity = list(prefix), capacity
        self.runner: Any = None
        self.caches: list | None = None
        self.prefills = 0  # how many times the prefix was prefilled (tests read it)
        self.phase = "setup"  # where a failure happened: setup | prefill | decode
        if model.engine == "hf":
            # Raise Unavailable before any question is asked.
            if path == "hf-quantized":
                _hf_quantized_kwargs(kv)
            elif path == "fused":
                _kvtax_hf()
            return
        from kvtax.models import Runner

        arm = parse_arm(kv)  # a hybrid base and per-layer formats: the runner's caches
        self.runner = Runner(model.model, kv=arm.base, overrides=arm.layers or None,
                             sliding_kv=arm.sliding(model.sliding_kv),
                             chunk_size=model.chunk_size)

    def _prefill_prefix(self) -> None:
        self.runner.release_graph()
        self.caches = self.runner.make_caches(capacity=self.capacity)
        if self.prefix:
            self.runner.prefill(torch.tensor([self.prefix]), self.caches)
        self.prefills += 1

    @torch.no_grad()
    def ask(self, suffix: list[int], budget: int) -> list[int]:
        """The answer's token ids to prefix + `suffix` (EOS excluded)."""
        if self.model.engine == "hf":
            self.phase = "decode"  # generate() does both; the error text tells which
            return self.model.hf_generate(self.prefix + list(suffix), self.kv, self.path,
                                          budget)
        from kvtax.errors import CapacityError

        try:
            self.phase = "prefill"
            if self.caches is None:
                self._prefill_prefix()
            caches = self.caches
            assert caches is not None
            logits = self.runner.prefill(torch.tensor([list(suffix)]), caches)
            self.phase = "decode"
            out = self.model.greedy(self.runner, caches, logits, budget)
        except BaseException:
            self.caches = None  # state unknown after a failure: start over next time
            raise
        try:
            for c in caches:
                c.trim(c.length - len(self.prefix))
        except CapacityError:
            self.caches = None
        return out


def _hf_quantized_kwargs(kv: str) -> dict[str, Any]:
    """transformers' QuantizedCache for `kv` ("int4", "int2", "int8"), if a backend exists."""
    from kvtax.formats import AffineFormat, KVSpec

    spec = KVSpec.parse(kv)
    if spec.key != spec.value or not isinstance(spec.key, AffineFormat):
        raise Unavailable(f"transformers' QuantizedCache has no {kv!r} (same int format for K, V)")
    bits, group = spec.key.n_bits, spec.key.group_size
    import importlib.util

    for backend, module, ok_bits in (("quanto", "optimum.quanto", (2, 4)),
                                     ("hqq", "hqq", (1, 2, 3, 4, 8))):
        if importlib.util.find_spec(module.split(".")[0]) and bits in ok_bits:
            return {"cache_implementation": "quantized",
                    "cache_config": {"backend": backend, "nbits": bits, "q_group_size": group}}
    raise Unavailable(
        f"transformers' QuantizedCache needs optimum-quanto (2/4 bits) or hqq for {kv}; "
        "neither is installed. Without /hf-quantized the arm runs kvtax's cache instead."
    )


def _eos_ids(*sources: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for s in sources:
        if s is None:
            continue
        for x in (s if isinstance(s, (list, tuple)) else [s]):
            if x is not None and int(x) not in ids:
                ids.append(int(x))
    return tuple(ids)


def load_recall_model(
    source: str,
    *,
    engine: str = "auto",
    dtype: str = "float32",
    device: str = "cpu",
    chunk_size: int = 2048,
    sliding_kv: str | None = None,
    seed: int = 0,
) -> RecallModel:
    """Load `source` (built-in config name, HF folder, `.gguf` file or hub id) for recall.

    engine "auto" uses kvtax (every KV format) and falls back to transformers when the
    kvtax loader cannot read the checkpoint, saying why.
    """
    if engine not in ("auto", "kvtax", "hf"):
        raise ValueError(f"engine must be auto, kvtax or hf, not {engine!r}")
    dtype_t = torch_dtype(dtype)
    path = Path(source).expanduser()
    is_gguf = path.suffix == ".gguf"
    if engine in ("auto", "kvtax"):
        try:
            return _load_kvtax(source, path, is_gguf, dtype_t, device, chunk_size,
                               sliding_kv, seed)
        except Exception as exc:  # noqa: BLE001 - any loader failure means "try transformers"
            if engine == "kvtax":
                raise
            print(f"kvtax recall: the kvtax loader cannot read {source} ({exc}); "
                  "using transformers (unquantized KV only)")
    return _load_hf(source, path, is_gguf, dtype_t, device)


def _load_kvtax(source: str, path: Path, is_gguf: bool, dtype: torch.dtype, device: str,
                chunk_size: int, sliding_kv: str | None, seed: int) -> RecallModel:
    from kvtax.models import ByteTokenizer, load_model, load_tokenizer

    folder = gguf_folder(path) if is_gguf else source
    model = load_model(str(folder), dtype=dtype, device=device, seed=seed)
    tok = load_tokenizer(model)
    if isinstance(tok, ByteTokenizer):
        text_tok: TextTokenizer = ByteTextTokenizer(tok.bos_token_id, tok.eos_token_id)
    else:
        text_tok = HFTextTokenizer(tok.tok)  # type: ignore[attr-defined]
    eos = _eos_ids(getattr(text_tok, "eos_token_id", None), model.config.eos_token_id)
    return RecallModel(source, "kvtax", model, text_tok, eos, chunk_size, sliding_kv)


def _load_hf(source: str, path: Path, is_gguf: bool, dtype: torch.dtype,
             device: str) -> RecallModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtax.models.tokenizer_check import check_tokenizer

    if is_gguf:
        where, extra = str(path.parent), {"gguf_file": path.name}
    else:
        where, extra = source, {}
    tok = AutoTokenizer.from_pretrained(where, **extra)
    check_tokenizer(tok, source)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **extra).to(device).eval()
    eos = _eos_ids(tok.eos_token_id, model.generation_config.eos_token_id)
    return RecallModel(source, "hf", model, HFTextTokenizer(tok), eos)
