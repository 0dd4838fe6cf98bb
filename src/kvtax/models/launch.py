"""Launch overrides of a decode step's kernels, for experiments: the shipped heuristics
unless told otherwise.

    >>> launch = DecodeLaunch.parse("o.block_n=2,down.block_k=1024,attn.per_sm=12")
    >>> runner = Runner(model, kv="int4", launch=launch)     # every step launches so

Items are `SCOPE.FIELD=INT`, comma-separated. SCOPE `gemv` (every fused GEMV) or one
projection (`qkv`, `o`, `gate_up`, `down`, `lm_head`) replaces GemvConfig fields of that
launch's `default_config`; a projection's items win over `gemv`'s. An overridden GEMV
launches exactly as configured (no RoPE register cap: see kvtax.models.gemv). SCOPE `attn`
forces keywords of the decode attention launch (`swap_decode_config` /
`warp_decode_config`, whichever the heuristic picks), e.g. `attn.per_sm=6`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")
GEMV_SCOPES = ("gemv", *PROJECTIONS)


def _gemv_fields() -> set[str]:
    from kvtax.models.gemv import GemvConfig

    return {f.name for f in dataclasses.fields(GemvConfig)}


def attention_fields() -> set[str]:
    """The decode attention launch keywords an `attn.FIELD` item may force: those both
    decode configs (swap and warp) take."""
    from kvtax.attention import triton_api as ta

    common = (set(inspect.signature(ta.swap_decode_config).parameters)
              & set(inspect.signature(ta.warp_decode_config).parameters))
    return common - {"q", "view", "lengths"}


@dataclass(frozen=True)
class DecodeLaunch:
    """GEMV and decode-attention launch overrides (all empty: the shipped launches).

    gemv: scope ("gemv" or a projection name) → {GemvConfig field: value}.
    attention: {decode config keyword: value}, forced into the heuristic's choice.
    """

    gemv: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    attention: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kvtax.errors import OptionError

        fields = _gemv_fields() if self.gemv else set()  # (Triton: only when overriding)
        for scope, changes in self.gemv.items():
            bad = set(changes) - fields
            if scope not in GEMV_SCOPES or bad:
                raise OptionError(f"GEMV override {scope}: {sorted(changes)} (scopes "
                                  f"{GEMV_SCOPES}, fields {sorted(fields)})")
        if self.attention:
            bad = set(self.attention) - attention_fields()
            if bad:
                raise OptionError(f"attention launch fields {sorted(bad)} are not among "
                                  f"{sorted(attention_fields())}")

    @classmethod
    def parse(cls, text: str) -> "DecodeLaunch":
        """`text` ("" = no overrides; syntax in the module docstring) → a DecodeLaunch.
        Raises OptionError naming a bad item."""
        from kvtax.errors import OptionError

        gemv: dict[str, dict[str, int]] = {}
        attn: dict[str, int] = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, _, value = item.partition("=")
            scope, _, name = key.partition(".")
            if scope not in (*GEMV_SCOPES, "attn") or not name or not value.isdigit():
                raise OptionError(f"launch item {item!r} is not SCOPE.FIELD=INT with SCOPE "
                                  f"attn or one of {GEMV_SCOPES}")
            (attn if scope == "attn" else gemv.setdefault(scope, {}))[name] = int(value)
        return cls(gemv=gemv, attention=attn)

    @property
    def is_default(self) -> bool:
        return not (self.gemv or self.attention)

    def gemv_config(self, projection: str, x: torch.Tensor, w: torch.Tensor,
                    silu_mul: bool = False):  # noqa: ANN201 (GemvConfig | None: needs Triton)
        """The GemvConfig `projection`'s gemv(x, w, silu_mul=...) call launches with, or None
        (no override: gemv's own default)."""
        changes = {**self.gemv.get("gemv", {}), **self.gemv.get(projection, {})}
        if not changes:
            return None
        from kvtax.models.gemv import default_config_for

        return dataclasses.replace(default_config_for(x, w, silu_mul=silu_mul), **changes)

    def attention_config(self, q: torch.Tensor, view, softcap: float | None = None):  # noqa: ANN001, ANN201
        """The decode attention LaunchConfig of q `[B, H_q, L, D]` over `view` with the
        `attention` keywords forced, or None (no override, or the heuristic picked a
        launch other than the swap / warp decode kernels)."""
        if not self.attention:
            return None
        from kvtax.attention import triton_api as ta

        lengths = view.length_t
        base = ta.launch_config(q, view, lengths, softcap=bool(softcap))
        make = {"swap": ta.swap_decode_config, "warp": ta.warp_decode_config}.get(base.kernel)
        return None if make is None else make(q, view, lengths, **self.attention)

    def attend(self, q: torch.Tensor, view, *, scale: float | None = None,  # noqa: ANN001
               softcap: float | None = None) -> torch.Tensor:
        """kvtax.attention.attention(q, view) with the forced decode launch: q `[B, H_q, L,
        D]` → `[B, H_q, L, D]`. Where the kernels cannot serve the call, or no override
        applies, the ordinary dispatch."""
        from kvtax.attention import attention
        from kvtax.attention import triton_api as ta
        from kvtax.attention.checks import rotate_query, unrotate_output

        if ta.unsupported_reason(q, view) is not None:
            return attention(q, view, scale=scale, softcap=softcap)
        qr = rotate_query(q, view)  # the kernels read the stored (rotated) domain
        cfg = self.attention_config(qr, view, softcap)
        if cfg is None:
            return attention(q, view, scale=scale, softcap=softcap)
        out = ta.triton_attention(qr, view, scale=scale, softcap=softcap, config=cfg)
        return unrotate_output(out, view)


DEFAULT = DecodeLaunch()
