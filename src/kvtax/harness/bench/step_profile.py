"""Where a decode step's GPU time goes: kernel time by kind and the critical path by role.

From torch.profiler over a few decode steps (CUDA-graph replays included: CUPTI reports
the kernels inside a replayed graph); benchmarks/decode.py --profile records it per cell.
"""

from __future__ import annotations

import torch


# kernel name → kind, first match wins (cuBLAS/CUTLASS GEMV-GEMM names vary by version)
_KINDS = (
    ("gemm", ("gemv_",)),  # kvtax's fused GEMV; its split-K reduce is no attention reduce
    ("attention", ("decode_", "prefill_attn", "reduce_kernel")),  # with or without a "_"
    ("store", ("quantize_store", "store_")),
    ("gemm", ("gemv", "gemm", "cutlass", "xmma", "sm90_", "cublas", "splitk", "matmul")),
    ("norm", ("rms_norm", "rmsnorm", "norm", "rsqrt")),  # rsqrt: inductor's fused norms
)


def kernel_breakdown(runner, step, tok, n: int, greedy: bool = True) -> dict:  # noqa: ANN001
    """GPU kernel time per decode step by kind, from torch.profiler over `n` steps of
    `step(tok) -> next tok` (token ids `[B, 1]` on CUDA) driven by kvtax Runner `runner`.

    The steps run as the timing ran them: CUDA-graph replays (CUPTI reports the kernels
    inside a replayed graph), compiled or not; eager steps with --no-cuda-graph.
    `ms/token - kernel_ms_per_step` is then the idle time between kernels.
    """
    from torch.profiler import ProfilerActivity, profile

    if not tok.is_cuda or n <= 0:
        return {}
    tok = step(tok)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            tok = step(tok)
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    launches = 0
    top: dict[str, float] = {}
    for evt in prof.key_averages():
        us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        skip = ("cudaLaunch", "cuLaunch", "cudaGraph", "Memcpy", "Memset")
        if not us or evt.key.startswith(skip):
            continue
        name = evt.key.lower()
        kind = next((k for k, keys in _KINDS if any(x in name for x in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1000 / n
        launches += evt.count
        top[evt.key[:80]] = top.get(evt.key[:80], 0.0) + us / 1000 / n
    return {
        "profiled": "graph" if runner.graph_captured(greedy) and runner.cuda_graph else "eager",
        "kernel_ms_per_step": sum(by_kind.values()),
        "kernel_ms_by_kind": {k: round(v, 4) for k, v in sorted(by_kind.items())},
        "launches_per_step": launches / n,
        "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:12]),
        "gemv_by_shape": gemv_by_shape(prof, n, runner.model),
        "critical_us_by_role": critical_path(kernel_spans(prof), n,
                                             runner.model.config.num_layers),
    }


def kernel_spans(prof) -> list[tuple[str, float, float]]:  # noqa: ANN001
    """(name, start µs, end µs) of every device kernel the profiler saw."""
    return [(e.name, e.time_range.start, e.time_range.end)
            for e in prof.events() if _is_device_kernel(e)]


# kernel name → role in a decode step (critical_path); GEMVs get their projection by order
# (matched with any leading "_" dropped)
_ROLES = (("gemv_reduce", "gemv split-K reduce"), ("quantize_store", "store"),
          ("store_", "store"), ("decode_attn_reduce", "attention reduce"),
          ("decode_", "attention"))


def _projection_order(layers: int) -> list[str]:
    """The fused GEMV launches of one decode step, in order: four per layer, then lm_head."""
    return ["qkv", "o", "gate_up", "down"] * layers + ["lm_head"]


def critical_path(spans: list[tuple[str, float, float]], n: int, layers: int) -> dict:
    """`spans`: (kernel name, start µs, end µs) of `n` decode steps of a model of `layers`
    layers → µs per decode step by role (qkv, o, gate_up, down, lm_head, store, attention,
    attention reduce, other, idle): how far each kernel moved the end of the work done so
    far. Under programmatic dependent launch kernels overlap (a kernel starts while the
    one before it runs and waits inside), so their durations add up to more than the
    step; this attribution sums to the step's span instead: in the order they end, a
    kernel ending at `e` is charged e - max(E, its start), E the latest end before it,
    and a gap between E and its start (nothing running) is charged to idle. `n` steps;
    gaps over 50 µs are step boundaries (host time, not charged)."""
    names = _projection_order(layers)
    roles, k_gemv = [], 0
    for name, start, end in sorted(spans, key=lambda s: s[1]):  # launch order: GEMV roles
        name = name.lstrip("_")
        if name.startswith("gemv_kernel"):
            role = names[k_gemv % len(names)]
            k_gemv += 1
        else:
            role = next((r for key, r in _ROLES if name.startswith(key)), "other")
        roles.append((role, start, end))
    out: dict[str, float] = {}
    last_end = None
    for role, start, end in sorted(roles, key=lambda s: s[2]):
        if last_end is not None and start - last_end > 50.0:
            last_end = None  # a step boundary
        if last_end is None:
            out[role] = out.get(role, 0.0) + (end - start)
            last_end = end
            continue
        if start > last_end:
            out["idle"] = out.get("idle", 0.0) + (start - last_end)
        out[role] = out.get(role, 0.0) + max(0.0, end - max(last_end, start))
        last_end = max(last_end, end)
    return {k: round(v / n, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


ATTENTION_ROLES = ("attention", "attention reduce")


def attention_critical_us(runs: list[list[tuple[str, float, float]]]) -> list[float]:
    """µs of decode attention (split + reduce) on the critical path of each run of kernel
    spans, charged as `critical_path` charges it in a model's step: from the end of the
    kernel before it (the cache store), not from its own launch. So a standalone call
    timed behind its store compares with `decode.py --profile`'s per-layer figure."""
    return [sum(critical_path(run, 1, layers=1).get(r, 0.0) for r in ATTENTION_ROLES)
            for run in runs]


def gemv_by_shape(prof, n: int, model) -> dict:  # noqa: ANN001
    """Per projection (qkv, o, gate_up, down, lm_head): µs per call of the fused GEMV
    kernel, its weight bytes over that time (TB/s), and the idle µs before it (the end of
    the previous kernel to its start). The launches come in model order each step: four
    per layer, then lm_head; {} when the count does not say so (e.g. torch linears)."""
    kernels = sorted((e for e in prof.events() if _is_device_kernel(e)),
                     key=lambda e: e.time_range.start)
    gaps, last_end = {}, None
    for e in kernels:
        gaps[id(e)] = e.time_range.start - last_end if last_end is not None else float("inf")
        last_end = e.time_range.end
    gemvs = [e for e in kernels if e.name.lstrip("_").startswith("gemv_kernel")]
    layers = model.config.num_layers
    if not gemvs or len(gemvs) != n * (4 * layers + 1):
        return {}
    names = _projection_order(layers)
    blk = model.layers[0]
    weights = {"qkv": blk.attn.wqkv.weight, "o": blk.attn.wo.weight,
               "gate_up": blk.mlp.w13.weight, "down": blk.mlp.w2.weight,
               "lm_head": model.head_weight}
    out = {}
    for name, w in weights.items():
        calls = [e for i, e in enumerate(gemvs) if names[i % len(names)] == name]
        us = sum(e.time_range.elapsed_us() for e in calls) / len(calls)
        gap = [gaps[id(e)] for e in calls if gaps[id(e)] < 50.0]  # not a step boundary
        out[name] = {"us": round(us, 2), "bytes": w.numel() * w.element_size(),
                     "TBps": round(w.numel() * w.element_size() / us / 1e6, 3),
                     "gap_before_us": round(sum(gap) / max(len(gap), 1), 2)}
    return out


def _is_device_kernel(evt) -> bool:  # noqa: ANN001
    from torch.autograd import DeviceType

    skip = ("cudaLaunch", "cuLaunch", "cudaGraph", "Memcpy", "Memset")
    return evt.device_type == DeviceType.CUDA and not evt.name.startswith(skip)
