"""Sweep planning: cells = contexts x arms x repetitions, in a seeded random order.

Interleaving matters: running every rep of one arm back to back lets a slow drift
(thermals, a background job) masquerade as an arm effect. The order comes from one seed
recorded on every row, so a resumed run regenerates exactly the same cells and order.
Warm-up cells (labelled `warmup`, excluded from statistics) run first.

    >>> cells = plan_cells(SweepConfig(contexts=[512, 1024], kvs=["fp16", "int8"]))
    >>> cells[0].cell_id, cells[0].seq, cells[0].warmup
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtax.errors import FormatError
from kvtax.formats import KVSpec
from kvtax.formats.hybrid import HybridSpec, fit_kv
from kvtax.harness.kv_arm import KVArm, parse_arm
from kvtax.harness.schema import PATHS, arm_name, make_cell_id

QUANTIZED_ONLY = ("unfused", "dequant", "hf-quantized")


@dataclass
class SweepConfig:
    """Everything that defines a sweep; stored as config.json in the run folder."""

    model: str = "tiny"
    level: str = "model"                 # "model" (whole decoder) | "attention" (one op)
    contexts: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048])
    kvs: list[str] = field(default_factory=lambda: ["fp16", "int8", "int4"])
    paths: list[str] = field(
        default_factory=lambda: ["fused", "fp16", "unfused", "dequant", "hf-quantized"]
    )
    reps: int = 3
    warmup: int = 1                      # warm-up cells per arm, at the smallest context
    decode_tokens: int = 32
    chunk_size: int = 2048
    phases: list[str] = field(default_factory=lambda: ["prefill", "decode"])
    presize: bool = False                # preallocate the cache: no growth in any window
    quantized_kv_start: int = 0          # first tokens kept in fp16 (mlx-lm's delay)
    seed: int = 0                        # order seed (also seeds the model weights)
    device: str = "cpu"
    dtype: str = "float32"
    timeout_s: float = 600.0
    cv_threshold: float = 0.10
    claims: list[dict[str, Any]] = field(default_factory=list)
    batch: int = 1
    threads: int | None = None           # torch CPU threads per cell (None: 1 on CPU)
    cuda_graph: bool | None = None       # fused path: None = the runner's choice, False = eager
    worker: str = "forkserver"           # "forkserver" | "subprocess"
    # Attention-level cells: the layer shape (defaults to the model's when it has one).
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    extra: dict[str, Any] = field(default_factory=dict)
    # Budgeting a long sweep (none of these change what a cell measures or its id):
    # path or arm name -> largest context it runs; larger cells get a "skipped" row saying so.
    max_context: dict[str, int] = field(default_factory=dict)
    # After an arm's OOM or timeout, its cells at that context or larger are "skipped" rows.
    skip_after_failure: bool = False
    # Order rep by rep (every rep-0 cell, shuffled, before any rep-1 cell): a sweep stopped
    # early has whole repetitions of every cell rather than random holes.
    rounds: bool = False
    # Contexts past the model's max_position_embeddings were asked for (--allow-long-context).
    allow_long_context: bool = False
    # Which stack runs the cells ("--engine"): kvtax's runner (its own cells below) or an
    # engine of kvtax.harness.engines; its extras (threads, urls, flash attention...).
    engine: str = "kvtax"
    engine_options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SweepConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    def cell_threads(self) -> int | None:
        """CPU cells default to one thread: batch-1 decode ops are too small to split, and
        waking a thread pool per op adds noise larger than the op on a shared machine."""
        if self.threads is not None:
            return self.threads
        return 1 if self.device == "cpu" else None

    def resolved_head_dim(self) -> int:
        """head_dim of the model (built-in name or checkpoint folder), else `head_dim`."""
        shape = model_shape(self.model)
        return shape[2] if shape else int(self.head_dim)

    def arms(self) -> list[tuple[str, str]]:
        """(kv, path) pairs: fused for every format, fp16 once, baselines for quantized kv;
        another engine's arms are its own (`Engine.arms`)."""
        if self.engine != "kvtax":
            from kvtax.harness.engines import get_engine

            return get_engine(self.engine).arms(list(self.kvs), list(self.paths))
        out: list[tuple[str, str]] = []
        for path in self.paths:
            if path not in PATHS:
                raise ValueError(f"unknown path {path!r}; choose from {', '.join(PATHS)}")
            if path == "fp16":
                out.append(("fp16", "fp16"))
                continue
            for kv in self.kvs:
                arm = self._arm(kv)
                if not arm.is_plain:  # hybrid / per-layer: kvtax's own attention reads them
                    if path == "fused":
                        out.append((arm.cache, path))
                    continue
                spec = resolve_kv(arm.base, self.resolved_head_dim())
                if path in QUANTIZED_ONLY and not spec.is_quantized:
                    continue  # a baseline for dequantizing has nothing to do on fp16
                out.append((spec.name, path))
        return list(dict.fromkeys(out))  # drop repeats, keep order


    def _arm(self, kv: str) -> KVArm:
        """`kv` (kvtax.harness.kv_arm) fitted to the head_dim and checked; FormatError where
        it names a path (that is --paths' job) or cannot run at this level."""
        arm = parse_arm(kv)
        if arm.path is not None:
            raise FormatError(f"--kv {kv}: name the cache only; paths go in --paths")
        if arm.is_plain:
            return arm
        if self.level != "model":
            raise FormatError(f"--kv {kv}: fp16 sinks/recent and per-layer formats run at "
                              "--level model")
        hd = self.resolved_head_dim()
        arm = arm.fit(hd)
        try:
            arm.check(hd, _num_layers(self.model))
        except FormatError as exc:
            raise FormatError(f"--kv {kv}: {exc}") from None
        return arm


def _num_layers(model: str) -> int | None:
    """The layer count of `model`'s config (None where there is none to read)."""
    from kvtax.errors import ModelNotFoundError
    from kvtax.models import model_config

    try:
        return int(model_config(model).num_layers)
    except ModelNotFoundError:
        return None


def model_shape(model: str) -> tuple[int, int, int] | None:
    """(query heads, KV heads, head_dim) of a built-in config, a local HF folder, a .gguf
    file or a hub id; None when `model` names none of these (attention level: --heads)."""
    from kvtax.errors import ModelNotFoundError
    from kvtax.models import model_config

    try:
        cfg = model_config(model)
    except ModelNotFoundError:
        return None
    assert cfg.head_dim is not None
    return cfg.num_heads, cfg.num_kv_heads, cfg.head_dim


def resolve_kv(kv: str, head_dim: int, option: str = "--kv") -> "KVSpec | HybridSpec":
    """A format name made valid for `head_dim`: "int8" on head_dim 32 → "int8-g32"
    (`kvtax.formats.fit_head_dim`; rotation and centering kept); a hybrid one (q4,
    int4+hk@s4r128) has its body fitted, its sinks / recent tokens kept.

    Only the default group size is adapted, and an explicit one wider than the row
    (`-g128` at 64 → 64); any other explicit `-g<N>` that does not divide head_dim is an
    error the user should see, naming `option`.
    """
    spec = fit_kv(kv, head_dim)
    try:
        spec.check(head_dim)
    except FormatError as exc:
        raise FormatError(f"{option} {kv}: {exc}") from None
    return spec


@dataclass
class Cell:
    """One measurement: one arm at one context, one repetition, in its own process."""

    cell_id: str
    seq: int
    order_seed: int
    rep: int
    warmup: bool
    kind: str
    model: str
    level: str
    kv: str
    path: str
    context: int
    chunk_size: int
    decode_tokens: int
    phases: list[str]
    presize: bool
    quantized_kv_start: int
    device: str
    dtype: str
    seed: int
    batch: int
    threads: int | None
    cuda_graph: bool | None
    heads: int
    kv_heads: int
    head_dim: int
    extra: dict[str, Any] = field(default_factory=dict)
    engine: str = "kvtax"
    engine_options: dict[str, Any] = field(default_factory=dict)

    @property
    def arm(self) -> str:
        return arm_name(self.kv, self.path)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["arm"] = self.arm
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Cell":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


def context_limit(cfg: SweepConfig, kv: str, path: str) -> int | None:
    """The largest context `cfg.max_context` lets arm kv/path run (None: no limit)."""
    limits = [int(v) for k, v in (cfg.max_context or {}).items()
              if k in (path, arm_name(kv, path))]
    return min(limits) if limits else None


def plan_cells(cfg: SweepConfig, kind: str = "bench") -> list[Cell]:
    """All cells of a sweep in run order: shuffled warm-ups, then shuffled measurements."""
    arms = cfg.arms()
    if not arms:
        raise ValueError("no arms: check --kv and --paths (baselines need a quantized format)")
    contexts = sorted(set(int(c) for c in cfg.contexts))
    if not contexts or contexts[0] <= 0:
        raise ValueError(f"contexts must be positive integers, got {cfg.contexts}")
    warm, meas = [], []
    for kv, path in arms:
        for w in range(cfg.warmup):
            warm.append((kv, path, contexts[0], w, True))
        for ctx in contexts:
            for rep in range(cfg.reps):
                meas.append((kv, path, ctx, rep, False))
    rng = random.Random(cfg.seed)
    rng.shuffle(warm)
    rng.shuffle(meas)
    if cfg.rounds:  # stable sort: shuffled within each repetition
        meas.sort(key=lambda m: m[3])
    cells = []
    for seq, (kv, path, ctx, rep, is_warm) in enumerate(warm + meas):
        params = dict(
            kind=kind, model=cfg.model, level=cfg.level, kv=kv, path=path, context=ctx,
            rep=rep, warmup=is_warm, chunk_size=cfg.chunk_size,
            decode_tokens=cfg.decode_tokens, phases=list(cfg.phases), presize=cfg.presize,
            quantized_kv_start=cfg.quantized_kv_start, device=cfg.device, dtype=cfg.dtype,
            seed=cfg.seed, batch=cfg.batch, threads=cfg.cell_threads(),
            cuda_graph=cfg.cuda_graph, heads=cfg.heads, kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim, extra=dict(cfg.extra), engine=cfg.engine,
            engine_options=dict(cfg.engine_options),
        )
        ident = dict(params, arm=arm_name(kv, path))
        if cfg.engine == "kvtax" and not cfg.engine_options:
            del ident["engine"], ident["engine_options"]  # ids of runs made before engines
        cells.append(Cell(cell_id=make_cell_id(ident), seq=seq, order_seed=cfg.seed, **params))
    return cells
