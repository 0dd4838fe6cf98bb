"""Chunked prefill and (CUDA-graph) decode over per-layer kvtax caches; `generate` on top.

At batch 1 a decode step is a few dozen small kernels per layer; launched from Python they
cost more than the bytes they read. On CUDA the runner captures one decode step in a CUDA
graph (static token/position/length buffers; the cache preallocated to prompt + budget so
storage never moves) and replays it per token. The graph needs the attention kernel to
read the cache length from the device (`view.length_t`, handed to the Triton kernels as
`lengths`); where it cannot (the torch reference on CPU or without Triton, a layer the
kernels do not serve, a swapped-in attention function that reads the host length), decode
runs eagerly and `runner.graph_disabled_reason` says why (printed once). A swapped-in
function that reads `view.length_t` says so with `fn.graph_blocker(q, view)` (the
harness's baselines: masked reads of the presized storage) and is captured like kvtax's.
Greedy decode (`decode_greedy`, and `generate` at temperature 0) captures the argmax with
the step: the graph writes the next token into its own input buffer and moves its
position and lengths on, so a token costs one replay and nothing between. The graph
itself, and the check that capture is safe, live in kvtax.models.decode_graph.

    >>> runner = Runner(load_model("tiny"), kv="int8")
    >>> result = runner.generate(torch.tensor([[1, 2, 3]]), 32)
    >>> result.tokens, result.decode_ms_per_token
"""

from __future__ import annotations

import resource
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtax.cache import BaseCache, FullCache, make_caches
from kvtax.cache.hybrid import HybridCache
from kvtax.errors import CapacityError, OptionError
from kvtax.formats import KVSpec, default_kv
from kvtax.formats.hybrid import HybridSpec, fit_kv
from kvtax.formats.spec import centering_conflict
from kvtax.models import argmax
from kvtax.models.decode_graph import DecodeGraph, clear_unwritten, graph_blocker
from kvtax.models.decoder import DecoderModel, gemv_blocker
from kvtax.models.launch import DecodeLaunch
from kvtax.models.sampling import sample


@dataclass
class GenerationResult:
    """What one `generate` call produced and how fast.

    tokens: generated ids (prompt excluded). ttft_s: prefill + first token. Rates are per
    second over the prefill and the decode steps after the first token (the one-time
    CUDA-graph capture, `graph_capture_s`, excluded). peak_bytes: CUDA peak allocated
    (CPU: process peak RSS). cache_bytes: allocated KV cache bytes.
    """

    tokens: list[int]
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_ms_per_token: float
    peak_bytes: int
    cache_bytes: int
    prompt_tokens: int = 0
    cache_used_bytes: int = 0
    cuda_graph: bool = False
    stopped_on_eos: bool = False
    graph_capture_s: float = 0.0


class Runner:
    """Runs a DecoderModel over kvtax caches of one KV format.

    kv:         format of global layers ("fp16", "int8", "int4", "k8v4", ...; None:
                `kvtax.formats.default_kv(...)`, int8 with Hadamard-rotated, centered
                keys, not centered where the model soft-caps attention logits). A name
                without `-g<N>` takes a group size dividing head_dim (`fit_head_dim`;
                `runner.spec.name` says which: int8-g32+hk+ck at head_dim 96). A hybrid
                format (`int4+hk@s4r128`, `q4`: fp16 sinks and recent window beside a
                quantized body) is captured like a plain one.
    sliding_kv: format of sliding-window layers (default: `kv`, or the form its short name
                stores there: q4 → k4-c64v4-g128@r64i8, kvtax.formats.spec.SLIDING_FORMS),
                e.g. "fp16".
    chunk_size: prefill chunk in tokens (bounds activation memory at long prompts).
    cuda_graph: None → on for CUDA models; False forces eager decode.
    overrides:  layer index → format (e.g. keep layer 0 in fp16).
    compile:    torch.compile the captured decode step (True: inductor, or a backend
                name) so norms, RoPE, residual adds and activations fuse into fewer
                kernels before the graph is captured; CUDA-graph decode only.
    fused_gemv: decode steps' linear layers as kvtax's Triton GEMVs with the norms,
                SiLU·up and residual adds fused (`DecoderModel.set_fused_gemv`, which
                this sets on the model). None → on for CUDA models whose architecture
                they cover (`gemv_blocker`), True forces (OptionError where not), False off.
    launch:     an experiment's launch overrides of the decode step's GEMVs and decode
                attention (kvtax.models.launch.DecodeLaunch, set on the model); None:
                the shipped heuristics.
    """

    def __init__(
        self,
        model: DecoderModel,
        kv: str | KVSpec | HybridSpec | None = None,
        *,
        sliding_kv: str | KVSpec | HybridSpec | None = None,
        chunk_size: int = 2048,
        cuda_graph: bool | None = None,
        overrides: dict[int, str | KVSpec | HybridSpec] | None = None,
        compile: bool | str = False,
        fused_gemv: bool | None = None,
        launch: DecodeLaunch | None = None,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if compile and launch is not None and launch.attention:
            raise OptionError("attention launch overrides call the kernels directly: they "
                              "cannot be compiled (compile=False)")
        self.model = model
        softcap = model.config.attn_softcap
        hd = model.config.head_dim
        assert hd is not None
        # names without a group size take one dividing head_dim (Phi-3's 96: int8-g32+hk+ck)
        self.spec = fit_kv(default_kv(softcap) if kv is None else kv, hd)
        self.sliding_spec = fit_kv(sliding_kv, hd) if sliding_kv else None
        self.overrides = None if overrides is None else {
            i: fit_kv(s, hd) for i, s in overrides.items()}
        for s in (self.spec, self.sliding_spec, *(self.overrides or {}).values()):
            if s is not None:  # say so now, not at the first attention call
                why = centering_conflict(s.base if isinstance(s, HybridSpec) else s, softcap)
                if why is not None:
                    raise OptionError(why)
        self.chunk_size = chunk_size
        self.device = model.embed.weight.device
        is_cuda = self.device.type == "cuda"
        if cuda_graph and not is_cuda:
            raise OptionError("cuda_graph=True needs a model on a CUDA device")
        self.cuda_graph = is_cuda if cuda_graph is None else cuda_graph
        if compile and not self.cuda_graph:
            raise OptionError("compile compiles the CUDA-graph decode step: it needs a model "
                              "on a CUDA device with CUDA-graph decode on")
        self.compile = compile
        if fused_gemv is None:
            # argmax.runs_on: Triton kernels run here (False on a CUDA install without Triton)
            fused_gemv = is_cuda and gemv_blocker(model.config) is None and argmax.runs_on(
                self.device)
        elif fused_gemv and gemv_blocker(model.config) is None:
            from kvtax.models.gemv import runs_on  # needs Triton: imported when asked for

            if not runs_on(self.device):
                raise OptionError("fused_gemv=True needs a model on a CUDA device (or the "
                                  "Triton interpreter)")
        # one place sets the model's switch; OptionError for architectures it does not cover
        model.set_fused_gemv(fused_gemv)
        model.set_launch(launch)
        self.fused_gemv = fused_gemv
        self.graph_disabled_reason: str | None = None
        self._graph: DecodeGraph | None = None  # decode_step's (logits out)
        self._greedy: DecodeGraph | None = None  # decode_greedy's (next token out)
        self._blocked: tuple | None = None

    def make_caches(self, capacity: int | None = None) -> list[BaseCache]:
        """One cache per layer; `capacity` (prompt + new tokens) preallocates global layers.

        Sliding layers get a fixed ring of window - 1 + chunk slots, so with `capacity`
        set no storage ever moves (what CUDA-graph decode needs).
        """
        chunk = self.chunk_size if capacity is None else min(self.chunk_size, capacity)
        return make_caches(
            self.model.config.layer_windows(), self.spec, sliding_spec=self.sliding_spec,
            overrides=self.overrides, capacity=capacity, max_chunk=chunk,
            # A finiteness check reads the GPU back each append; keep it to CPU runs.
            check_finite=self.device.type == "cpu",
        )

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, caches: Sequence[BaseCache]) -> torch.Tensor:
        """Feed `input_ids` `[B, T]` in chunks of `chunk_size`; logits `[B, vocab]` (float32)
        of the last position. Appends after whatever the caches already hold."""
        ids = self._ids(input_ids)
        start = caches[0].length
        logits = None
        for s in range(0, ids.shape[1], self.chunk_size):
            chunk = ids[:, s : s + self.chunk_size]
            pos = torch.arange(start + s, start + s + chunk.shape[1], device=self.device)
            logits = self.model(chunk, list(caches), pos)
        assert logits is not None
        return logits[:, -1].float()

    @torch.no_grad()
    def decode_step(self, token_ids: torch.Tensor, caches: Sequence[BaseCache]) -> torch.Tensor:
        """One token per row, `token_ids` `[B, 1]` → logits `[B, vocab]` (float32).

        Replays a CUDA graph when enabled and safe, else runs eagerly.
        """
        tok = self._ids(token_ids)
        if tok.shape[1] != 1:
            raise ValueError(f"decode_step takes [B, 1] token ids, got {tuple(tok.shape)}")
        if self.cuda_graph and self._graph_ok(caches):
            return self._replay(tok, caches)
        n = caches[0].length
        pos = torch.arange(n, n + 1, device=self.device)
        return self.model(tok, list(caches), pos)[:, -1].float()

    @torch.no_grad()
    def decode_greedy(self, token_ids: torch.Tensor, caches: Sequence[BaseCache]) -> torch.Tensor:
        """One greedy step: token ids `[B, 1]` → the next ids `[B, 1]` int64 (the logits'
        argmax), left on the device.

        With a CUDA graph the argmax is part of the replayed step, which writes the token
        into the graph's input buffer and returns that buffer: feed it back and each token
        is one replay with no copies between (it is overwritten by the next call; clone
        what you keep). Otherwise `sample(decode_step(...))`.
        """
        tok = self._ids(token_ids)
        if tok.shape[1] != 1:
            raise ValueError(f"decode_greedy takes [B, 1] token ids, got {tuple(tok.shape)}")
        if self.cuda_graph and argmax.runs_on(self.device) and self._graph_ok(caches, True):
            self._check_room(caches)
            return self._greedy.step_greedy(tok, caches[0].length, caches)  # type: ignore[union-attr]
        return sample(self.decode_step(tok, caches))

    def graph_captured(self, greedy: bool = True) -> bool:
        """Whether a decode graph is held: decode_greedy's (`greedy`) or decode_step's."""
        return (self._greedy if greedy else self._graph) is not None

    def release_graph(self) -> None:
        """Drop the captured decode graphs (and their memory pools) before building new
        caches."""
        self._graph = self._greedy = None

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        ignore_eos: bool = False,
        eos_token_id: int | Sequence[int] | None = None,
        on_token: Callable[[int], None] | None = None,
        seed: int = 0,
    ) -> GenerationResult:
        """Prefill a batch-1 prompt `[1, T]` then decode up to `max_new_tokens` tokens.

        Stops at an EOS id (default: the config's) unless `ignore_eos`. `on_token` is
        called with each new id as it is produced (streaming). Without `on_token` and with
        `ignore_eos` the loop never waits for the GPU until the end (benchmarking).
        """
        ids = self._ids(torch.as_tensor(input_ids))
        if ids.shape[0] != 1:
            raise ValueError("generate runs one prompt (batch 1); use prefill/decode_step for more")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        eos = _eos_set(eos_token_id, self.model.config.eos_token_id)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.release_graph()
        caches = self.make_caches(capacity=ids.shape[1] + max_new_tokens)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        sampling = dict(temperature=temperature, top_p=top_p, generator=gen)

        t0 = _now(self.device)
        tok = sample(self.prefill(ids, caches), **sampling)
        first = int(tok.item())
        t1 = _now(self.device)
        if on_token:
            on_token(first)
        stopped = not ignore_eos and first in eos
        t_capture = t1
        if self.cuda_graph and not stopped and max_new_tokens > 1:
            # capture now: a one-time cost, kept out of decode rates
            self._graph_ok(caches, greedy=temperature == 0 and argmax.runs_on(self.device))
            t_capture = _now(self.device)
        later, stopped = ([], stopped) if stopped else self._decode_loop(
            tok, caches, max_new_tokens - 1, sampling, eos if not ignore_eos else None,
            on_token)
        t2 = _now(self.device)
        n_dec, t_dec = len(later), t2 - t_capture
        return GenerationResult(
            tokens=[first, *later],
            ttft_s=t1 - t0,
            prefill_tokens_per_s=ids.shape[1] / max(t1 - t0, 1e-9),
            decode_tokens_per_s=n_dec / t_dec if n_dec else 0.0,
            decode_ms_per_token=1000 * t_dec / n_dec if n_dec else 0.0,
            peak_bytes=_peak_bytes(self.device),
            cache_bytes=sum(c.nbytes for c in caches),
            prompt_tokens=ids.shape[1],
            cache_used_bytes=sum(c.used_nbytes for c in caches),
            cuda_graph=(self._greedy if temperature == 0 else self._graph) is not None,
            stopped_on_eos=stopped,
            graph_capture_s=t_capture - t1,
        )

    def _decode_loop(
        self, tok: torch.Tensor, caches: list[BaseCache], budget: int, sampling: dict,
        eos: set[int] | None, on_token: Callable[[int], None] | None,
    ) -> tuple[list[int], bool]:
        """Decode up to `budget` tokens after `tok` `[1, 1]`; (their ids, stopped on an id
        in `eos`). Without `on_token` and `eos` the loop never waits for the GPU: the
        tokens stay on the device until the end (benchmarking)."""
        stream = on_token is not None or eos is not None
        out: list = []
        while len(out) < budget:
            if sampling["temperature"] == 0:
                tok = self.decode_greedy(tok, caches)
            else:
                tok = sample(self.decode_step(tok, caches), **sampling)
            if not stream:
                out.append(tok.clone())  # decode_greedy's graph reuses its token buffer
                continue
            t = int(tok.item())
            out.append(t)
            if on_token:
                on_token(t)
            if eos is not None and t in eos:
                return out, True
        if not stream and out:
            out = torch.cat(out).view(-1).tolist()
        return out, False

    # -- CUDA graph ---------------------------------------------------------------------

    def _graph_ok(self, caches: Sequence[BaseCache], greedy: bool = False) -> bool:
        """Whether a decode graph (the greedy one with `greedy`) serves `caches`; captures
        one when none does and capture is safe."""
        g = self._greedy if greedy else self._graph
        if g is not None and g.serves(caches):
            return True
        if self._blocked is not None and self._blocked[0] == id(caches) and (
            self._blocked[1]() is caches[0]
        ):
            return False  # already found unsafe for this cache set: stay eager, stay quiet
        reason = graph_blocker(self.model, caches)
        if reason is not None:
            if reason != self.graph_disabled_reason:
                print(f"kvtax: CUDA-graph decode off, running eagerly: {reason}", file=sys.stderr)
            self.graph_disabled_reason = reason
            self._blocked = (id(caches), weakref.ref(caches[0]))
            return False
        clear_unwritten(self.model, caches)
        g = DecodeGraph.capture(self.model, caches, compile=self.compile, greedy=greedy)
        if greedy:
            self._greedy = g
        else:
            self._graph = g
        self.graph_disabled_reason = None
        return True

    def _replay(self, tok: torch.Tensor, caches: Sequence[BaseCache]) -> torch.Tensor:
        g = self._graph
        assert g is not None
        self._check_room(caches)
        return g.step(tok, caches[0].length, caches)

    @staticmethod
    def _check_room(caches: Sequence[BaseCache]) -> None:
        n = caches[0].length
        for c in caches:
            # An index past capacity inside the graph would be a device-side assert.
            full = isinstance(c, FullCache) or (isinstance(c, HybridCache) and c.window is None)
            if full and n + 1 > c.capacity:
                raise CapacityError(
                    f"cache full ({c.capacity} tokens); make caches with capacity >= prompt + "
                    "max new tokens"
                )

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids if ids.dim() == 2 else ids.view(1, -1)
        if ids.shape[1] == 0:
            raise ValueError("no tokens to run")
        return ids.to(device=self.device, dtype=torch.long)


def _eos_set(given: int | Sequence[int] | None, default: Sequence[int]) -> set[int]:
    if given is None:
        return set(default)
    return {given} if isinstance(given, int) else set(given)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is KiB on Linux: the CPU run's process peak, weights included.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
