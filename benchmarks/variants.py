"""Launch variants for decode.py: override the GEMV and decode-attention launch defaults.

A variant is comma-separated `SCOPE.FIELD=INT` items; decode.py times every cell once per
variant, in one process (the model is built once; each cell captures its own graph):

    gemv.block_k=1024             every fused GEMV launch (a kvtax.models.gemv.GemvConfig field)
    o.block_n=2,down.block_k=1024 one projection: qkv, o, gate_up, down or lm_head
    attn.per_sm=12                the decode-attention launch (swap_decode_config /
                                  warp_decode_config keyword arguments, forced)
    pdl.on=0,pdl.first=0          programmatic dependent launch (kvtax.pdl) on / off, and
                                  the GEMVs' wait: first thing (0), after the first W tile
                                  (1), after it except in qkv's RoPE launch (2), only
                                  in the residual launches, o and down (3), or in
                                  those and qkv's (4)
    pdl.attn=0,pdl.store=0        one kernel family not launched with PDL (it still lets
                                  the next kernel launch early): gemv, store, attn (the
                                  decode attention kernels) or reduce (their split-KV merge)
    pdl.attn_late=1               that family lets the next kernel launch at its end, not
                                  first thing (kvtax.pdl.LATE)
    step.greedy=0                 time decode_step + sample (logits out of the graph, the
                                  argmax after it) instead of decode_greedy (argmax in the
                                  graph); read by decode.py
    step.rope_freqs=0             the qkv GEMV reads RoPE tables built per step instead of
                                  building them from the positions (DecoderModel.rope_freqs)

`apply(text, model)` is a context manager; the defaults come back when it exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator

PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")
# pdl.FIELD: on (kvtax.pdl.USE_PDL), first (the GEMVs' PDL_FIRST), or a kernel family of
# kvtax.pdl.KINDS (variant name → family name)
PDL_FIELDS = {"on": None, "first": None, "gemv": "gemv", "store": "store",
              "attn": "attention", "reduce": "reduce"}
# pdl.FAMILY_late=1: that family lets the next kernel launch at its end (kvtax.pdl.LATE)
LATE_FIELDS = {f"{k}_late": v for k, v in PDL_FIELDS.items() if v}


def parse(text: str) -> dict[str, dict[str, int]]:
    """`text` → {scope: {field: value}}; raises SystemExit naming a bad item."""
    from kvtax.attention import launch_table as ta
    from kvtax.models import gemv as gm

    gemv_fields = {f.name for f in dataclasses.fields(gm.GemvConfig)}
    attn_fields = (set(inspect.signature(ta.swap_decode_config).parameters)
                   & set(inspect.signature(ta.warp_decode_config).parameters)) - {
                       "q", "view", "lengths"}
    out: dict[str, dict[str, int]] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        scope, _, field = key.partition(".")
        fields = {"attn": attn_fields, "pdl": {*PDL_FIELDS, *LATE_FIELDS},
                  "step": {"greedy", "rope_freqs"}}.get(scope, gemv_fields)
        if scope not in ("gemv", "attn", "pdl", "step", *PROJECTIONS) or \
                field not in fields or not value.isdigit():
            raise SystemExit(
                f"variant item {item!r} is not SCOPE.FIELD=INT: SCOPE gemv / "
                f"{' / '.join(PROJECTIONS)} with FIELD in {sorted(gemv_fields)}, attn with "
                f"FIELD in {sorted(attn_fields)}, or pdl.FIELD with FIELD in "
                f"{sorted({*PDL_FIELDS, *LATE_FIELDS})}, or step.greedy / step.rope_freqs")
        out.setdefault(scope, {})[field] = int(value)
    return out


def _projection_keys(model) -> dict[tuple[int, int, bool], str]:  # noqa: ANN001
    """(n, k, silu_mul) of each projection's default_config call → its name."""
    blk = model.layers[0]
    shapes = {"qkv": (blk.attn.wqkv.weight, False), "o": (blk.attn.wo.weight, False),
              "gate_up": (blk.mlp.w13.weight, True), "down": (blk.mlp.w2.weight, False),
              "lm_head": (model.head_weight, False)}
    return {(w.shape[0] // (2 if silu else 1), w.shape[1], silu): name
            for name, (w, silu) in shapes.items()}


def greedy_step(text: str, default: bool = True) -> bool:
    """Whether variant `text` times the greedy graph step (step.greedy; else `default`)."""
    return bool(parse(text).get("step", {}).get("greedy", default))


@contextlib.contextmanager
def apply(text: str, model) -> Iterator[None]:  # noqa: ANN001
    """Run the body with the launch defaults of variant `text` ("" = the defaults)."""
    from kvtax import pdl as kp
    from kvtax.attention import launch_table as ta
    from kvtax.attention import op
    from kvtax.models import gemv as gm

    spec = parse(text)
    saved = (gm.default_config, ta.swap_decode_config, ta.warp_decode_config)
    saved_pdl = kp.USE_PDL, kp.KINDS, kp.LATE, gm.PDL_FIRST
    saved_freqs = model.rope_freqs
    keys = _projection_keys(model)
    base_gemv, base_swap, base_warp = saved

    def gemv_config(n, k, *, silu_mul=False, **kw):  # noqa: ANN001, ANN202
        cfg = base_gemv(n, k, silu_mul=silu_mul, **kw)
        changes = {**spec.get("gemv", {}), **spec.get(keys.get((n, k, silu_mul), ""), {})}
        return dataclasses.replace(cfg, **changes) if changes else cfg

    def forced(base):  # noqa: ANN001, ANN202
        return lambda q, view, lengths=None, **kw: base(q, view, lengths,
                                                        **{**kw, **spec["attn"]})

    op.forget_launch_configs()  # launch configs cached per cache layout: decide them afresh
    try:
        if set(spec) - {"attn", "pdl", "step"}:
            gm.default_config = gemv_config
        pdl = spec.get("pdl", {})
        kp.USE_PDL = bool(pdl.get("on", kp.USE_PDL))
        gm.PDL_FIRST = int(pdl.get("first", gm.PDL_FIRST))
        for names, attr in ((PDL_FIELDS, "KINDS"), (LATE_FIELDS, "LATE")):
            off = {names[f] for f, v in pdl.items() if names.get(f) and not v}
            on = {names[f] for f, v in pdl.items() if names.get(f) and v}
            setattr(kp, attr, frozenset((getattr(kp, attr) | on) - off))
        model.rope_freqs = bool(spec.get("step", {}).get("rope_freqs", saved_freqs))
        if "attn" in spec:
            ta.swap_decode_config, ta.warp_decode_config = forced(base_swap), forced(base_warp)
        yield
    finally:
        gm.default_config, ta.swap_decode_config, ta.warp_decode_config = saved
        kp.USE_PDL, kp.KINDS, kp.LATE, gm.PDL_FIRST = saved_pdl
        model.rope_freqs = saved_freqs
        op.forget_launch_configs()
