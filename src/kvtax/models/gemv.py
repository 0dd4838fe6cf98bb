"""Decode GEMV with fused neighbours: RMSNorm prologue, SiLU(gate)·up and residual epilogues.

    >>> from kvtax.models.gemv import gemv, gemv_reference, unsupported_reason
    >>> y = gemv(x, w)                                        # x [M, K] (M <= 4), w [N, K]
    >>> y = gemv(x, wqkv, norm_weight=attn_norm.weight)       # F.linear(rms_norm(x), wqkv)
    >>> y = gemv(x, w13, norm_weight=g, silu_mul=True)        # silu(gate) * up, [M, N / 2]
    >>> y = gemv(a, wo, residual=h)                           # h + F.linear(a, wo)
    >>> qkv = gemv(x, wqkv, norm_weight=g, rope=(cos, sin, n_qk))  # q, k rotated (rope.py)
    >>> qkv = gemv(x, wqkv, norm_weight=g, rope=(positions, inv_freq, n_qk))  # the same

The kernels (`kernels/gemv.py`) read W once as a streaming read and accumulate in fp32;
the math is `gemv_reference`'s. On CPU the kernel runs only when Triton's interpreter
built it (`TRITON_INTERPRET=1` when this module was first imported; how the tests run
it): `unsupported_reason` says so, and callers fall back to the torch path.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

import torch
import torch.nn.functional as F
import triton

from kvtax import pdl
from kvtax.errors import OptionError, ShapeError
from kvtax.models.kernels.gemv import gemv_kernel, gemv_reduce_kernel
from kvtax.models.rope import apply_rope, rope_cos_sin

MAX_ROWS = 4  # decode batch; the kernel keeps one fp32 tile per input row in registers
MAX_SPLIT_K = 16
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NUM_WARPS = 4  # per program, every launch (the register budget of default_config)
H200_SMS = 132  # the default's target when no CUDA device is visible (interpreter, meta)
ROPE_MAXNREG = 80  # register cap of the one-row RoPE launch (see _gemv)
POISON_WORKSPACE = False  # tests: NaN-fill the split-K workspace so an unwritten partial shows
# Programmatic dependent launch of the main kernel: kvtax.pdl (KVTAX_PDL=0 turns it off).
# The residual launches (o, down) and the RoPE launch (qkv) wait after issuing their
# first W tile, the others (gate/up, lm_head) first thing: held across the wait, gate/up's
# tile costs 120 registers instead of 80 (4 programs per SM instead of 6; Triton 3.6,
# sm_90). Llama-3.1-8B on the H200 at 32k, ms per token, waits placed so / only in o and
# down / everywhere / everywhere but qkv: int4 4.254 / 4.286 / 4.263 / 4.301; at 32k-128k
# 0 to -0.4% against o and down only in every cell (docs/BENCHMARKS.md).


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch of `gemv`: W tile `[block_n, block_k]` per loop step, `split_k` programs per
    block of `block_n` rows (each a contiguous K slice), products summed in groups of
    `fold` columns each step (the kernel's FOLD). block_n, block_k and fold are powers of
    two. Every launch runs NUM_WARPS warps in one stage (default_config's register
    budget assumes them)."""

    block_n: int = 16
    block_k: int = 512
    split_k: int = 1
    fold: int = 1

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "fold"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise OptionError(f"GemvConfig.{name}={v} must be a power of two")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise OptionError(f"GemvConfig.split_k={self.split_k} must be in 1..{MAX_SPLIT_K}")
        if self.fold > self.block_k:
            raise OptionError(f"GemvConfig.fold={self.fold} must be <= block_k={self.block_k}")

    @property
    def tag(self) -> str:
        return (f"n{self.block_n}-k{self.block_k}-s{self.split_k}"
                + (f"-f{self.fold}" if self.fold > 1 else ""))


@lru_cache(maxsize=256)
def default_config(
    n: int, k: int, *, rows: int = 1, silu_mul: bool = False, elem_bytes: int = 2,
    num_sms: int = H200_SMS,
) -> GemvConfig:
    """The heuristic launch for output width `n` (SILU_MUL: n = intermediate size) and `k`.

    A loop step reads 1 KiB of each W row (512 bf16: one 16-byte load per thread across a
    warp, twice) and block_n <= 8 rows, fewer where the fp32 tiles (rows x (2 with
    SILU_MUL)) would pass ~32 registers per thread. Split-K only where the row blocks
    would not give every SM a program: on the H200 every Llama-3.1-8B decode shape ran
    fastest unsplit with 8-row blocks or within 0.4 us of it (benchmarks/gemv.py --sweep:
    o 15.9 vs 18.1 us split 4, down 36.1 vs 38.4, qkv 19.1 vs 21.8 split 2),
    and a split costs a second launch in the model (0.145 ms per token for 96).
    Two adjustments measured inside the model (decode.py --gemv-override, H200,
    µs per call): 4-row blocks where 8-row ones would give fewer than 4 programs per
    SM (o 10.9 vs 11.1, down 29.7 vs 30.5; qkv's 5.8 per SM lost with them: 16.9 vs 14.5),
    and 2 KiB per row per step where there are 16+ programs per SM to stream (gate/up 57.5
    vs 59.5, lm_head 236.4 vs 244.1; 64 accumulator registers, still no spill).
    Measured on the H200 (in the model under PDL, one row): where the 4-row rule applies (o,
    down) and for gate/up, 2-row blocks reading 4 KiB of each row per step, with each
    step's products folded in groups of 8 bytes of W (`fold`, so the accumulators stay
    small): down 29.2 -> 26.4 µs per call (its bytes alone: 26.0), o 9.9 -> 7.9, gate/up
    within 0.2%; Llama-3.1-8B int4 at 32k 4.437 -> 4.316 ms per token. Longer runs still
    (whole 8 KiB rows: gate/up 69.6 µs; down 2 x 4096: 4.400 ms) and folding alone (more
    programs per SM, same tiles: 4.541 ms at fold 8) measured slower.
    """
    block_k = min(1024 // elem_bytes, triton.next_power_of_2(k))
    tiles = rows * (2 if silu_mul else 1)
    budget = 32 * 32 * NUM_WARPS  # fp32 accumulator elements per program
    block_n = max(1, min(budget // (block_k * tiles), triton.next_power_of_2(n), 8))
    block_n = 1 << int(math.log2(block_n))
    blocks = triton.cdiv(n, block_n)
    fold = 1
    long_runs = (rows == 1 and triton.cdiv(n, 2) >= num_sms  # no split-K needed
                 and (silu_mul or (block_n == 8 and blocks < 4 * num_sms)))
    if long_runs:  # (measured at one row)
        block_n = min(2, block_n)
        block_k = min(4096 // elem_bytes, triton.next_power_of_2(k))
        fold = min(max(1, 8 // elem_bytes), block_k)
        blocks = triton.cdiv(n, block_n)
    elif block_n == 8 and blocks < 4 * num_sms:
        block_n = 4
        blocks = triton.cdiv(n, block_n)
    elif blocks >= 16 * num_sms and rows == 1:  # (measured at one row)
        block_k = min(2 * block_k, triton.next_power_of_2(k))
    split_k = 1
    max_split = min(MAX_SPLIT_K, triton.cdiv(k, block_k))
    while blocks * split_k < num_sms and split_k * 2 <= max_split:
        split_k *= 2
    return GemvConfig(block_n, block_k, split_k, fold)


def _interpreting() -> bool:
    """True when Triton's interpreter built the kernel (then it also runs on CPU tensors)."""
    return type(gemv_kernel).__name__ == "InterpretedFunction"


def _pdl(x: torch.Tensor, rope: bool = False, residual: bool = False) -> dict:
    """The main kernel's programmatic dependent launch keywords (kvtax.pdl; {}: off) for a
    launch with or without the RoPE / the residual epilogue: PDL_FIRST (the wait after
    the first W tile) in those two, not in the others."""
    if not pdl.enabled("gemv", x, _interpreting()):
        return {}
    return {"PDL": True, "PDL_FIRST": rope or residual, "launch_pdl": True}


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device` (CUDA, or CPU when interpreted)."""
    return device.type == "cuda" or _interpreting()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_SMS


def default_config_for(x: torch.Tensor, w: torch.Tensor, *, silu_mul: bool = False) -> GemvConfig:
    """The `default_config` that gemv(x, w, silu_mul=...) launches with (x `[..., K]`, w
    `[N, K]`; before RoPE narrows it): the base an experiment's overrides replace fields of."""
    k = x.shape[-1]
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    return default_config(n, k, rows=x.numel() // k, silu_mul=silu_mul,
                          elem_bytes=w.element_size(), num_sms=_num_sms(x.device))


def _out_shape(x: torch.Tensor, w: torch.Tensor, silu_mul: bool) -> tuple[int, ...]:
    return (*x.shape[:-1], w.shape[0] // 2 if silu_mul else w.shape[0])


def unsupported_reason(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    out: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> str | None:
    """None when `gemv` can serve this call, else why not. Arguments as for `gemv`."""
    if not (x.is_cuda or _interpreting()):
        return "tensors are not on a CUDA device (on CPU the kernel runs only interpreted)"
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        return f"x and w must share a float16/bfloat16/float32 dtype (got {x.dtype}, {w.dtype})"
    if x.dim() < 1 or w.dim() != 2:
        return f"x {tuple(x.shape)} must be [..., K] and w {tuple(w.shape)} [N, K]"
    k = x.shape[-1]
    if w.shape[1] != k or k == 0:
        return f"x {tuple(x.shape)} and w {tuple(w.shape)} disagree on K (or K is 0)"
    if w.stride(1) != 1 or w.stride(0) < k:
        return f"w must have contiguous rows (strides {w.stride()})"
    rows = x.numel() // k
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} input rows (the kernel takes 1..{MAX_ROWS}: decode batches)"
    if silu_mul and w.shape[0] % 2:
        return f"silu_mul needs gate and up halves: w has an odd row count {w.shape[0]}"
    if w.shape[0] == 0:
        return "w has no rows"
    shape = _out_shape(x, w, silu_mul)
    n = shape[-1]
    tensors = [w]
    if norm_weight is not None:
        if norm_weight.shape != (k,) or norm_weight.dtype not in DTYPES:
            return (f"norm_weight must be a float [{k}] vector (got {tuple(norm_weight.shape)}, "
                    f"{norm_weight.dtype})")
        tensors.append(norm_weight)
    if bias is not None:
        if silu_mul:
            return "bias with silu_mul (a bias on gate/up) is not supported"
        if bias.shape != (n,) or bias.dtype not in DTYPES:
            return f"bias must be a float [{n}] vector (got {tuple(bias.shape)}, {bias.dtype})"
        tensors.append(bias)
    if residual is not None:
        if residual.shape not in (shape, (rows, n)) or residual.dtype != x.dtype:
            return (f"residual {tuple(residual.shape)} {residual.dtype} must be {shape} "
                    f"{x.dtype}")
        tensors.append(residual)
    if out is not None:
        if out.shape not in (shape, (rows, n)) or out.dtype != x.dtype:
            return f"out {tuple(out.shape)} {out.dtype} must be {shape} {x.dtype}"
        if not out.is_contiguous():
            return "out must be contiguous"
        tensors.append(out)
    if rope is not None:
        reason = _rope_reason(x, rope, n, rows, silu_mul, residual is not None)
        if reason is not None:
            return reason
        tensors += list(rope[:2])
    if any(t.device != x.device for t in tensors):
        return "all tensors must be on x's device"
    return None


def _rope_freqs(rope: tuple) -> bool:
    """Whether `rope` is (positions, inv_freq, rows) rather than (cos, sin, rows) tables."""
    return not rope[0].is_floating_point()


def _rope_head_dim(rope: tuple) -> int:
    return 2 * rope[1].numel() if _rope_freqs(rope) else rope[0].shape[-1]


def _rope_tables(rope: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, signed sin) `[T, D]` tables `rope` stands for, in `dtype` (rope.py's)."""
    if _rope_freqs(rope):
        return rope_cos_sin(rope[0], rope[1], dtype)
    return rope[0], rope[1]


def _rope_reason(x: torch.Tensor, rope: tuple, n: int, rows: int, silu_mul: bool,
                 residual: bool) -> str | None:
    """Why `rope` = (cos, sin, rotated rows) or (positions, inv_freq, rotated rows) does not
    fit this call, or None."""
    cos, sin, rot = rope
    if silu_mul or residual:
        return "rope is an epilogue of plain projections (not with silu_mul / residual)"
    if _rope_freqs(rope):
        if cos.dim() != 1 or not cos.is_contiguous() or sin.dim() != 1 or \
                sin.dtype != torch.float32 or not sin.is_contiguous():
            return (f"rope (positions, inv_freq) must be a contiguous integer [T] and a "
                    f"contiguous float32 [D / 2] (got {tuple(cos.shape)} {cos.dtype}, "
                    f"{tuple(sin.shape)} {sin.dtype})")
        t, d = cos.shape[0], 2 * sin.shape[0]
    else:
        if cos.dim() != 2 or cos.shape != sin.shape or cos.stride(-1) != 1 or \
                sin.stride() != cos.stride():
            return f"rope tables must be two [T, D] row-contiguous tensors ({tuple(cos.shape)})"
        t, d = cos.shape
    if d < 2 or d & (d - 1) or n % d:
        return f"rope head_dim {d} must be a power of two dividing the output width {n}"
    if rows % t or x.dim() < 2 or x.shape[-2] != t:
        return f"rope tables hold {t} positions; x {tuple(x.shape)} must be [..., {t}, K]"
    if not 0 <= rot <= n or rot % d:
        return f"rope rows {rot} must be a multiple of head_dim {d} within the {n} outputs"
    return None


def gemv_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    norm_offset: bool = False,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    gelu: bool = False,
    out_dtype: torch.dtype | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """What `gemv` computes, in float32 torch; the result cast to `out_dtype` (x's dtype).

    xn = x · rsqrt(mean(x²) + eps) · g (g = norm_weight, or 1 + g with norm_offset; no
    norm without it); y = xn @ w.T (+ bias); with silu_mul y = act(y[..., :N/2]) · y[..., N/2:]
    (act: SiLU, or GELU-tanh with gelu); with rope = (cos, sin, rows) the first `rows`
    outputs rotated per head (kvtax.models.rope.apply_rope on fp32 tables; rope =
    (positions, inv_freq, rows): the tables rope_cos_sin builds in x's dtype);
    y += residual. Any leading shape of x; no rounding between the steps.
    """
    h = x.float()
    if norm_weight is not None:
        g = norm_weight.float() + (1.0 if norm_offset else 0.0)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * g
    y = F.linear(h, w.float(), None if bias is None else bias.float())
    if rope is not None:
        cos, sin = _rope_tables(rope, x.dtype)
        rot, d = rope[2], cos.shape[-1]
        heads = y[..., :rot].unflatten(-1, (rot // d, d))  # [..., T, H, D]
        turned = apply_rope(heads, cos.float()[:, None], sin.float()[:, None])
        y = torch.cat([turned.flatten(-2), y[..., rot:]], dim=-1)
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    if residual is not None:
        y = y + residual.float().reshape(y.shape)
    return y.to(out_dtype or x.dtype)


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    norm_offset: bool = False,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    gelu: bool = False,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """y = [residual +] act(rmsnorm(x) @ w.T [+ bias]) for decode-sized x, in one or two
    launches.

    x: `[..., K]` with M = x.numel() / K <= 4 rows (`[M, K]` or `[B, 1, K]`), fp16 / bf16 /
    fp32. w: `[N, K]` in x's dtype, rows contiguous (an nn.Linear weight). norm_weight:
    `[K]` (any float dtype) fuses RMSNorm of x (eps; norm_offset: Gemma's 1 + g) before
    the product. bias: `[N]` (any float dtype; not with silu_mul) added to the product.
    silu_mul: w's rows are gate `[0, N/2)` then up `[N/2, N)`; the output is
    silu(gate) · up, `[..., N/2]` (gelu: GELU-tanh(gate) · up, Gemma's MLP). residual:
    the output's shape and dtype, added last (it may alias `out`). Returns `[..., N]` (or
    `[..., N/2]`) in x's dtype, written into `out` if given. rope: (cos, sin, rows) with
    kvtax.models.rope's tables `[T, D]` (x is `[..., T, K]`; input row m is position
    m % T): the first `rows` outputs (q and k heads of a qkv projection, a multiple of D)
    leave rotated, each head's pairs (d, d + D/2) in fp32 before the one rounding; not
    with silu_mul or residual; always unsplit. Or rope = (positions, inv_freq, rows):
    integer positions `[T]` and float32 inverse frequencies `[D / 2]`, the kernel building
    the tables rope_cos_sin would (in x's dtype) itself — no table kernels per step.
    fp32 accumulation; see `gemv_reference` for the exact math. config: a GemvConfig (default:
    `default_config`). Raises ShapeError for tensors the kernel cannot take
    (`unsupported_reason`).

    Example:
        h = gemv(x, wo, residual=x)          # x + x @ wo.T, x [1, 4096], wo [4096, 4096]
    """
    if eps <= 0 or not math.isfinite(eps):
        raise OptionError(f"eps must be a positive finite number (got {eps})")
    if gelu and not silu_mul:
        raise OptionError("gelu picks the gated MLP's activation: it needs silu_mul=True")
    reason = unsupported_reason(x, w, norm_weight=norm_weight, bias=bias, residual=residual,
                                silu_mul=silu_mul, out=out, rope=rope)
    if reason is not None:
        raise ShapeError(f"gemv cannot run: {reason}")
    cfg = None if config is None else (config.block_n, config.block_k, config.split_k,
                                       config.fold)
    if torch.compiler.is_compiling():
        cos, sin, rot = rope if rope is not None else (None, None, 0)
        y = _gemv_op(x, w, norm_weight, float(eps), norm_offset, bias, residual, silu_mul,
                     gelu, cfg, cos, sin, rot)
        if out is None:
            return y
        return out.copy_(y.view(out.shape))
    return _gemv(x, w, norm_weight, eps, norm_offset, bias, residual, silu_mul, gelu, config,
                 out, rope)


def _gemv(
    x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
    norm_offset: bool, bias: torch.Tensor | None, residual: torch.Tensor | None, silu_mul: bool,
    gelu: bool, config: GemvConfig | None, out: torch.Tensor | None,
    rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """The launch (inputs already checked)."""
    shape = _out_shape(x, w, silu_mul)
    k, n = x.shape[-1], shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    y2 = out.view(rows, n)
    r2 = y2
    if residual is not None:
        r2 = residual.reshape(rows, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    cfg = config or default_config(n, k, rows=rows, silu_mul=silu_mul,
                                   elem_bytes=w.element_size(), num_sms=_num_sms(x.device))
    if rope is not None:  # the rotation needs whole sums, and both halves of a head's rows
        d = _rope_head_dim(rope)
        bn = max(2, min(cfg.block_n, d))
        cfg = dataclasses.replace(cfg, split_k=1, block_n=bn)
    # K_PER: each split's K range, whole BLOCK_K steps; splits that would be empty are dropped
    k_per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per)
    split = splits > 1
    n_rows = w.shape[0] if split else n  # with split-K the main kernel sees gate/up as rows
    g = norm_weight.contiguous() if norm_weight is not None else x2
    b = bias.contiguous() if bias is not None else x2  # placeholders are never read
    opts = dict(num_warps=NUM_WARPS, num_stages=1)
    opts.update(_pdl(x, rope is not None, residual is not None))
    if (rope is not None and config is None and rows == 1 and x.is_cuda
            and cfg.block_n * cfg.block_k <= 8 * 512):
        # Triton 3.6 compiles the RoPE epilogue to 93 registers (sm_90; 3.9: 80, as without
        # it): 5 programs of 4 warps per SM instead of 6, and Llama-3.1-8B's 768 qkv
        # programs would run in two waves on 132 SMs. Capped at 80: 8 bytes spill (3.6).
        opts["maxnreg"] = ROPE_MAXNREG
    if split:
        alloc = _nan_filled if POISON_WORKSPACE else torch.empty
        ws = alloc((splits, rows, n_rows), dtype=torch.float32, device=x.device)
        ss = alloc((splits, rows), dtype=torch.float32, device=x.device)
    else:
        ws = ss = y2  # placeholders, never touched
    if rope is not None:
        cos, sin, rot = rope
        rope_args = (cos, sin, cos.stride(0), cos.shape[0], rot)  # freqs: stride unread
    else:
        rope_args = (x2, x2, 0, 1, 0)  # placeholders, never read
    gemv_kernel[(triton.cdiv(n_rows, cfg.block_n), splits)](
        x2, w, g, b, r2, y2, ws, ss,
        n_rows, k, k_per, x2.stride(0), w.stride(0), r2.stride(0), y2.stride(0), float(eps),
        *rope_args, ROPE=rope is not None, HEAD_DIM=_rope_head_dim(rope) if rope else 0,
        ROPE_FREQS=rope is not None and _rope_freqs(rope),
        ROWS=rows, NORM=norm_weight is not None, OFFSET=norm_offset,
        BIAS=bias is not None and not split, RESIDUAL=residual is not None and not split,
        SILU_MUL=silu_mul and not split, GELU=gelu, SPLIT=split,
        EVEN_K=k % k_per == 0 and k_per % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FOLD=cfg.fold, **opts,
    )
    if split:
        block = min(1024, triton.next_power_of_2(n))
        gemv_reduce_kernel[(triton.cdiv(n, block), rows)](
            ws, ss, b, r2, y2, n, n_rows, k, splits, r2.stride(0), y2.stride(0), float(eps),
            ROWS=rows, NORM=norm_weight is not None, BIAS=bias is not None,
            RESIDUAL=residual is not None,
            SILU_MUL=silu_mul, GELU=gelu, SPLITS_P=triton.next_power_of_2(splits), BLOCK_N=block,
            num_warps=4,
        )
    return out


def _nan_filled(shape: tuple[int, ...], **kw) -> torch.Tensor:  # noqa: ANN003
    return torch.full(shape, float("nan"), **kw)


# torch.compile sees gemv as one opaque op (as formats/store_triton.py does for the cache
# store: Inductor re-specializes user Triton kernels it traces). Functional: it returns a
# new tensor, so no aliasing annotations; the fake implementation gives the output shape.
_LIB = torch.library.Library("kvtax", "FRAGMENT")
_LIB.define(
    "gemv(Tensor x, Tensor w, Tensor? norm_weight, float eps, bool norm_offset, "
    "Tensor? bias, Tensor? residual, bool silu_mul, bool gelu, int[]? config, "
    "Tensor? rope_cos, Tensor? rope_sin, int rope_rows) -> Tensor"
)


def _gemv_body(x, w, norm_weight, eps, norm_offset, bias, residual, silu_mul, gelu, config,  # noqa: ANN001, ANN202
               rope_cos, rope_sin, rope_rows):
    cfg = GemvConfig(*config) if config is not None else None
    rope = (rope_cos, rope_sin, rope_rows) if rope_cos is not None else None
    return _gemv(x, w, norm_weight, eps, norm_offset, bias, residual, silu_mul, gelu, cfg, None,
                 rope)


def _gemv_fake(x, w, norm_weight, eps, norm_offset, bias, residual, silu_mul, gelu, config,  # noqa: ANN001, ANN202
               rope_cos, rope_sin, rope_rows):
    return x.new_empty(_out_shape(x, w, silu_mul))


for _key in ("CPU", "CUDA"):  # CPU: Triton's interpreter (tests)
    _LIB.impl("gemv", _gemv_body, _key)
torch.library.register_fake("kvtax::gemv", _gemv_fake, lib=_LIB)
_gemv_op = torch.ops.kvtax.gemv.default
