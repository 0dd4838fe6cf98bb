"""`torch.ops.kvtax.attention`: the fused kernels as one opaque op for torch.compile.

Inductor re-specializes user Triton kernels it traces (and failed to build them on the
H200 with Triton 3.6), and a graph break per layer would cut transformers' compiled
decode into 64 pieces, so `triton_attention` calls this op while compiling. Defined with
torch.library's plain API (one dispatcher hop to the body; `torch.library.custom_op`
adds ~30 us of Python per call) and inference only: no autograd formula.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kvtax.attention.launch import launch_attention
from kvtax.attention.launch_table import LaunchConfig, launch_config
from kvtax.attention.support import interpreting, unsupported_reason
from kvtax.attention.view import CacheView
from kvtax.formats import KVSpec, QTensor

_LIB = torch.library.Library("kvtax", "FRAGMENT")
_LIB.define(
    "attention(Tensor q, Tensor kc, Tensor? ks, Tensor? kb, Tensor vc, Tensor? vs, "
    "Tensor? vb, Tensor? length_t, Tensor? kv_start, str spec, SymInt head_dim, SymInt length, "
    "SymInt sinks, SymInt ring, SymInt window, ScalarType dtype, float scale, float softcap) "
    "-> Tensor"
)
# A compiled decode step calls the op once per layer with the same layouts: the launch
# configuration is derived once per layout key, not on every call.
_OP_CONFIGS: dict[tuple, LaunchConfig] = {}
_MAX_OP_CONFIGS = 256  # layouts one process sees are few; a bound against leaks


def forget_launch_configs() -> None:
    """Drop the op's cached launch configs (after changing what `launch_config` picks)."""
    _OP_CONFIGS.clear()


def cached_configs() -> int:
    """How many layouts the op has derived a launch config for."""
    return len(_OP_CONFIGS)


def attention_op(q: torch.Tensor, view: CacheView, lengths: torch.Tensor | None,
                 kv_start: torch.Tensor | None, scale: float | None,
                 softcap: float | None) -> torch.Tensor:
    """`triton_attention(q, view, ...)` through `torch.ops.kvtax.attention` (shapes as
    there): the view travels as its tensors and scalars."""
    return _OP(
        q, *view.k, *view.v, lengths if lengths is not None else view.length_t, kv_start,
        view.spec.name, view.head_dim, view.length, view.sinks, view.ring,
        -1 if view.window is None else view.window, view.dtype,
        -1.0 if scale is None else float(scale), float(softcap or 0.0),
    )


@lru_cache(maxsize=None)
def _spec(name: str) -> KVSpec:
    return KVSpec.parse(name)


def _layout(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def _attention_body(
    q: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor | None, kb: torch.Tensor | None,
    vc: torch.Tensor, vs: torch.Tensor | None, vb: torch.Tensor | None,
    length_t: torch.Tensor | None, kv_start: torch.Tensor | None, spec: str, head_dim: int,
    length: int, sinks: int, ring: int, window: int, dtype: torch.dtype, scale: float,
    softcap: float,
) -> torch.Tensor:
    view = CacheView(
        k=QTensor(kc, ks, kb), v=QTensor(vc, vs, vb), spec=_spec(spec), head_dim=head_dim,
        length=length, sinks=sinks, ring=ring, window=None if window < 0 else window,
        dtype=dtype, length_t=length_t,
    )
    key = (spec, head_dim, length, sinks, ring, window, dtype, _layout(q), _layout(length_t),
           kv_start is None, *(_layout(t) for t in (kc, ks, kb, vc, vs, vb)))
    config = _OP_CONFIGS.get(key)
    if config is None and unsupported_reason(q, view, allow_cpu=interpreting()) is None:
        if len(_OP_CONFIGS) >= _MAX_OP_CONFIGS:
            _OP_CONFIGS.clear()
        config = _OP_CONFIGS[key] = launch_config(q, view, length_t)
    return launch_attention(q, view, scale=None if scale < 0 else scale,
                            softcap=softcap or None, kv_start=kv_start, config=config)


def _attention_fake(q, kc, ks, kb, vc, vs, vb, length_t, kv_start, spec, head_dim, length,
                    sinks, ring, window, dtype, scale, softcap):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape)


for _key in ("CPU", "CUDA"):  # CPU: Triton's interpreter (tests)
    _LIB.impl("attention", _attention_body, _key)
torch.library.register_fake("kvtax::attention", _attention_fake, lib=_LIB)
_OP = torch.ops.kvtax.attention.default
