"""One decoder for Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2 and Gemma 3, switched by config.

The families differ in a handful of places, each a ModelConfig flag: qkv bias (Qwen2),
q/k RMSNorm (Qwen3, Gemma 3), (1 + w) RMSNorm, sandwich norms, sqrt(hidden) embedding
scale and GELU-tanh MLP (Gemma), attention and final-logit soft-capping (Gemma 2),
sliding-window layers with their own RoPE base (Gemma 3). Attention always goes through
the layer's kvtax cache: `cache.append(k, v)` then `attention(q, cache.view())`, so the
quantized cache is read as stored, never dequantized into a copy.

Fused GEMVs (`DecoderModel.set_fused_gemv(True)`; the model's default is off, the Runner
turns them on for CUDA models): decode-sized steps (B·T <= 4 rows) run each linear layer
as kvtax's Triton GEMV with its neighbours fused (`kvtax.models.gemv`): attn_norm + wqkv
(+ Qwen2's qkv bias), wo + residual, ffn_norm + w13 + SiLU·up, w2 + residual, final norm
+ lm_head (Gemma: (1 + w) norms, GELU-tanh, sandwich norms applied in torch). Other
steps (prefill) take the torch path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvtax.attention import attention
from kvtax.cache import BaseCache
from kvtax.errors import OptionError
from kvtax.models.config import ModelConfig
from kvtax.models.launch import DEFAULT, DecodeLaunch
from kvtax.models.rope import apply_rope, inv_frequencies, rope_cos_sin


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; `offset` = Gemma's `x̂ · (1 + w)` computed in float32."""

    def __init__(self, dim: int, eps: float, offset: bool) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:  # Gemma multiplies by (1 + w) in float32, then casts
            d = x.shape[-1:]
            return F.rms_norm(x.float(), d, 1.0 + self.weight.float(), self.eps).type_as(x)
        if x.dtype == torch.float32 or x.is_cuda:
            # One fused kernel on CUDA (decode launches hundreds of norms per token); in
            # low precision it rounds once where HF rounds before the weight multiply.
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention over a kvtax cache; q/k/v fused into one projection."""

    launch: DecodeLaunch = DEFAULT  # set through DecoderModel.set_launch

    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.cfg, self.window = cfg, window
        # The attention path; the harness swaps in a baseline of the same signature.
        self.attn_fn = attention
        hd, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.sizes = (hq * hd, hkv * hd, hkv * hd)
        # The fused qkv GEMV can rotate q and k itself (gemv's rope epilogue: head_dim a
        # power of two) unless q/k norms must come first (Qwen3, Gemma 3).
        self.rope_in_gemv = not cfg.qk_norm and hd >= 2 and hd & (hd - 1) == 0
        self.wqkv = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=bool(cfg.qkv_bias))
        self.wo = nn.Linear(hq * hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, bool(cfg.norm_offset))
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, bool(cfg.norm_offset))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: BaseCache,
        write_pos: torch.Tensor | None,
        length_t: torch.Tensor | None,
    ) -> torch.Tensor:
        """x `[B, T, hidden]` → `[B, T, hidden]`; writes this chunk's K/V into `cache`."""
        return self.wo(self.attend(self.wqkv(x), cos, sin, cache, write_pos, length_t))

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: BaseCache,
        write_pos: torch.Tensor | None,
        length_t: torch.Tensor | None,
        rotated: bool = False,
    ) -> torch.Tensor:
        """Projected qkv `[B, T, (Hq + 2 Hkv) D]` → attention output `[B, T, Hq D]` (before wo).
        `rotated`: q and k arrive rotated (the fused qkv GEMV's RoPE epilogue)."""
        b, t, _ = qkv.shape
        cfg = self.cfg
        hd, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        if cfg.qk_norm:
            assert not rotated, "q/k norms come before the rotation"
            q, k, v = qkv.split(self.sizes, dim=-1)
            q, k = self.q_norm(q.view(b, t, hq, hd)), self.k_norm(k.view(b, t, hkv, hd))
            qk = torch.cat([q, k], dim=2)
        else:
            qk, v = qkv.split([self.sizes[0] + self.sizes[1], self.sizes[2]], dim=-1)
            qk = qk.view(b, t, hq + hkv, hd)
        if rotated:
            q, k = qk.split([hq, hkv], dim=2)
        else:  # q and k in one pass (fewer launches per decode step)
            q, k = apply_rope(qk, cos[:, None], sin[:, None]).split([hq, hkv], dim=2)
        v = v.view(b, t, hkv, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if write_pos is None:
            cache.append(k, v)
            view = cache.view()
        else:
            # CUDA-graph decode: the slot and the length come from device tensors, so one
            # captured graph serves every step; the host length is advanced by the runner.
            # (A hybrid cache's view hands the device lengths to each of its parts.)
            cache.write_at(k, v, write_pos)
            view = cache.view().at_length(cache.length + t, length_t)
        fn = self.attn_fn
        if self.launch.attention and fn is attention:  # an experiment's forced launch
            fn = self.launch.attend
        out = fn(q, view, scale=cfg.scale, softcap=cfg.attn_softcap)  # [B, Hq, T, D]
        return out.transpose(1, 2).reshape(b, t, -1)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) · up(x)); gate and up fused into one projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w2(act * up)


class Block(nn.Module):
    """Pre-norm residual block; Gemma adds post-norms on both branches (sandwich)."""

    fused_gemv = False  # set through DecoderModel.set_fused_gemv
    launch: DecodeLaunch = DEFAULT  # set through DecoderModel.set_launch

    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        eps, off = cfg.rms_norm_eps, bool(cfg.norm_offset)
        self.attn = Attention(cfg, window)
        self.mlp = MLP(cfg)
        self.attn_norm = RMSNorm(cfg.hidden_size, eps, off)
        self.ffn_norm = RMSNorm(cfg.hidden_size, eps, off)
        self.sandwich = bool(cfg.sandwich_norm)
        if self.sandwich:
            self.post_attn_norm = RMSNorm(cfg.hidden_size, eps, off)
            self.post_ffn_norm = RMSNorm(cfg.hidden_size, eps, off)

    def fused(self, x: torch.Tensor) -> bool:
        """Whether `forward(x, ...)` runs the fused GEMV path (decode-sized x)."""
        return self.fused_gemv and _gemv_api().unsupported_reason(x, self.attn.wqkv.weight) is None

    def forward(self, x, cos, sin, cache, write_pos, length_t, freqs):  # noqa: ANN001, ANN201
        """freqs: (positions `[T]`, inv_freq fp32 `[D / 2]`) the tables cos / sin `[T, D]`
        were built from; the fused qkv GEMV builds its own from them (no table kernels in
        a decode step; cos / sin are then None)."""
        if self.fused(x):
            return self._forward_gemv(_gemv_api(), x, cos, sin, cache, write_pos, length_t,
                                      freqs)
        h = self.attn(self.attn_norm(x), cos, sin, cache, write_pos, length_t)
        x = x + (self.post_attn_norm(h) if self.sandwich else h)
        h = self.mlp(self.ffn_norm(x))
        return x + (self.post_ffn_norm(h) if self.sandwich else h)

    def _forward_gemv(self, gm, x, cos, sin, cache, write_pos, length_t, freqs):  # noqa: ANN001, ANN202
        """The decode step as four fused GEMVs (see `gemv_blocker` for the layers it takes).
        The qkv GEMV also rotates q and k (its RoPE epilogue: three elementwise launches
        fewer per layer) unless q/k norms (Qwen3, Gemma 3) must come first. Sandwich norms
        (Gemma) normalize a projection's whole output before the residual add, so there the
        add stays in torch after the norm."""
        attn, mlp = self.attn, self.mlp
        an, fn = self.attn_norm, self.ffn_norm
        cfg = self.launch.gemv_config if self.launch.gemv else _no_config
        rope = None
        if attn.rope_in_gemv:
            rope = (*freqs, attn.sizes[0] + attn.sizes[1])
        w = attn.wqkv.weight
        qkv = gm.gemv(x, w, norm_weight=an.weight, eps=an.eps, norm_offset=an.offset,
                      bias=attn.wqkv.bias, rope=rope, config=cfg("qkv", x, w))
        a = attn.attend(qkv, cos, sin, cache, write_pos, length_t, rotated=rope is not None)
        w = attn.wo.weight
        if self.sandwich:
            x = x + self.post_attn_norm(gm.gemv(a, w, config=cfg("o", a, w)))
        else:
            x = gm.gemv(a, w, residual=x, config=cfg("o", a, w))
        w = mlp.w13.weight
        h = gm.gemv(x, w, norm_weight=fn.weight, eps=fn.eps, norm_offset=fn.offset,
                    silu_mul=True, gelu=mlp.gelu, config=cfg("gate_up", x, w, True))
        w = mlp.w2.weight
        if self.sandwich:
            return x + self.post_ffn_norm(gm.gemv(h, w, config=cfg("down", h, w)))
        return gm.gemv(h, w, residual=x, config=cfg("down", h, w))


def _no_config(*_args: object) -> None:
    """No launch override (gemv's default config)."""
    return None


def _gemv_api():  # noqa: ANN202
    """kvtax.models.gemv, imported on first use (it needs Triton, an optional dependency)."""
    from kvtax.models import gemv

    return gemv


def gemv_blocker(cfg: ModelConfig) -> str | None:
    """Why this architecture cannot take the fused-GEMV decode path, or None."""
    if cfg.hidden_act not in ("silu", "gelu_tanh"):
        return f"{cfg.hidden_act} MLP (the epilogues are SiLU and GELU-tanh)"
    return None


class DecoderModel(nn.Module):
    """A decoder-only LM. `.config` is its ModelConfig.

    Example:
        model = DecoderModel(get_config("tiny"))
        caches = make_caches(model.config.layer_windows(), "int8")
        logits = model(ids, caches, positions=torch.arange(ids.shape[1]))   # [B, 1, vocab]
    """

    source: str | None = None  # the folder the weights came from (the tokenizer looks there)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.config = cfg
        windows = cfg.layer_windows()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, w) for w in windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, bool(cfg.norm_offset))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Sliding layers use the local RoPE base where the family has one (Gemma 3).
        self.local_rope = [w is not None and cfg.rope_local_theta is not None for w in windows]
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.register_buffer("inv_freq_local", torch.empty(cfg.head_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the float32 RoPE frequencies (after `to_empty`, or a cast to bf16)."""
        cfg = self.config
        assert cfg.head_dim is not None
        dev = self.embed.weight.device
        if dev.type == "meta":
            return
        self.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
        local_theta = cfg.rope_local_theta or cfg.rope_theta
        self.inv_freq_local = inv_frequencies(cfg.head_dim, local_theta).to(dev)

    fused_gemv = False  # see set_fused_gemv
    # The fused qkv GEMV builds its RoPE tables from the positions: no table kernels in a
    # decode step (227 launches instead of 235). H200, Llama-3.1-8B at 32k, ms per token,
    # positions / tables read: int4 4.265 / 4.261, int8 4.519 / 4.522, bf16 4.937 / 4.957.

    def set_fused_gemv(self, on: bool = True) -> None:
        """Route decode-sized steps (B·T <= 4 rows, CUDA, fp16/bf16/fp32) through the fused
        Triton GEMVs (on), or back to the torch path (off, the default). Raises OptionError
        for architectures the fusions do not cover (`gemv_blocker`)."""
        reason = gemv_blocker(self.config) if on else None
        if reason is not None:
            raise OptionError(f"fused GEMV decode does not support {self.config.name}: {reason}")
        if on:
            _gemv_api()  # fail here, not mid-forward, when Triton is missing
        self.fused_gemv = bool(on)
        for layer in self.layers:
            layer.fused_gemv = bool(on)

    launch: DecodeLaunch = DEFAULT  # see set_launch

    def set_launch(self, launch: DecodeLaunch | None = None) -> None:
        """Launch the decode step's GEMVs and decode attention with `launch`'s overrides
        (an experiment's; None: the shipped heuristics)."""
        self.launch = launch or DEFAULT
        for layer in self.layers:
            layer.launch = layer.attn.launch = self.launch

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(
        self,
        tokens: torch.Tensor,
        caches: list[BaseCache],
        positions: torch.Tensor,
        *,
        write_pos: torch.Tensor | None = None,
        length_t: torch.Tensor | None = None,
        last_only: bool = True,
    ) -> torch.Tensor:
        """Run `tokens` `[B, T]` at `positions` `[T]` (int64, on the model's device).

        Returns logits `[B, 1, vocab]` of the last position (`last_only`) or `[B, T, vocab]`,
        in the model dtype. `write_pos`/`length_t` (device tensors) select the graph-safe
        cache write used by CUDA-graph decode.
        """
        cfg = self.config
        if len(caches) != cfg.num_layers:
            raise ValueError(f"{len(caches)} caches for {cfg.num_layers} layers")
        x = self.embed(tokens)
        if cfg.embed_scale:
            x = x * torch.tensor(math.sqrt(cfg.hidden_size), dtype=x.dtype)
        # tables only where a layer reads them: not when every qkv GEMV builds its own
        tables = not all(layer.attn.rope_in_gemv and layer.fused(x) for layer in self.layers)
        rope = rope_cos_sin(positions, self.inv_freq, x.dtype) if tables else (None, None)
        rope_local = rope_cos_sin(positions, self.inv_freq_local, x.dtype) if tables and any(
            self.local_rope
        ) else rope
        for layer, cache, local in zip(self.layers, caches, self.local_rope):
            cos, sin = rope_local if local else rope
            inv = (self.inv_freq_local if local else self.inv_freq).float()  # as rope_cos_sin
            x = layer(x, cos, sin, cache, write_pos, length_t, freqs=(positions, inv))
        if last_only:
            x = x[:, -1:]
        gm = _gemv_api() if self.fused_gemv else None
        if gm is not None and gm.unsupported_reason(x, self.head_weight) is None:
            logits = gm.gemv(x, self.head_weight, norm_weight=self.norm.weight, eps=self.norm.eps,
                             norm_offset=self.norm.offset,
                             config=self.launch.gemv_config("lm_head", x, self.head_weight)
                             if self.launch.gemv else None)
        else:
            logits = F.linear(self.norm(x), self.head_weight)
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits
