"""Why is compiled decode slow? Profile a few decode steps of transformers' `generate`.

For each arm (transformers' StaticCache, kvtax int8/int4 preallocated caches) one
`generate` call on a Llama-3.1-8B-shaped model (random weights) reads a `--context`-token
prompt and decodes `--warmup-steps` tokens (compile, CUDA-graph warm-up and recording),
then `--steps` tokens under `torch.profiler`. A logits processor, which generate calls
right after every forward, marks the steps. Written to `<out>/summary.txt` (and printed),
plus `<out>/summary.json`, per arm:

- wall ms per step (CUDA events) and host ms per step (perf_counter, process CPU time);
- CUDA kernels per step and their busy ms per step; host launch calls per step
  (cudaLaunchKernel / cuLaunchKernel*, cudaGraphLaunch: CUDA graphs replayed or not);
- the top CUDA kernels by total time, and the host time of the kvtax custom ops;
- dynamo/inductor counters (graphs compiled, recompiles, cudagraph skips) and the log
  lines of torch's `recompiles`, `graph_breaks`, `cudagraphs` and `perf_hints` logs
  ("skipping cudagraphs due to ..." says why CUDA graphs were not used);
- for kvtax arms: host microseconds per call of `kvtax::attention` and
  `kvtax::quantize_store` on layer 0's real storage (the cost a step pays 32 times
  each when no CUDA graph replays it).

    python benchmarks/hf_profile.py --out /tmp/prof                       # H200, 8B, 32k
    python benchmarks/hf_profile.py --device cpu --config tiny --context 64 \\
        --backend aot_eager --out /tmp/prof-cpu                          # CPU smoke run

`--trace` also writes each arm's Chrome trace (gzip) beside the summary.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import logging
import pathlib
import statistics
import sys
import time
import warnings
from collections import Counter

import torch
import transformers
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

import kvtax.hf as kh
from kvtax.hf.cache import cache_kwarg
from kvtax.hf.models import llama31_8b_config, tiny_config

ARMS = ("static", "kvtax-int8", "kvtax-int4")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
LOG_WORDS = ("cudagraph", "recompil", "graph break", "graph_break", "skipping", "fallbackkernel")
TOP = 15


class StepProbe(LogitsProcessor):
    """Runs after every forward of generate: times steps, starts and stops the profiler.

    Call 0 follows the prefill; calls 1..warmup are untimed decode steps; the profiler
    runs from call `warmup` to call `warmup + steps`, i.e. over `steps` whole steps.
    """

    def __init__(self, device: torch.device, warmup: int, steps: int, prof) -> None:
        self.cuda = device.type == "cuda"
        self.warmup, self.steps, self.prof = warmup, steps, prof
        self.calls = 0
        self.marks: list[tuple] = []  # (cuda event | None, perf_counter, process_time)

    def __call__(self, input_ids, scores):
        i = self.calls
        self.calls += 1
        if self.warmup <= i <= self.warmup + self.steps:
            event = None
            if self.cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            self.marks.append((event, time.perf_counter(), time.process_time()))
            if i == self.warmup:
                self.prof.start()
            elif i == self.warmup + self.steps:
                self.prof.stop()
        return scores


class LogLines(logging.Handler):
    """Keeps torch log records that name recompiles, graph breaks or CUDA-graph skips."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # a record whose args do not format
            return
        if any(w in msg.lower() for w in LOG_WORDS):
            self.lines.append(" ".join(msg.split())[:400])


def _torch_loggers() -> list[logging.Logger]:
    """torch's loggers that print themselves (torch._logging stops them propagating)."""
    import torch._dynamo  # noqa: F401  (creates the dynamo and inductor loggers)
    import torch._inductor.cudagraph_trees  # noqa: F401

    return [lg for name, lg in logging.root.manager.loggerDict.items()
            if name.startswith("torch") and isinstance(lg, logging.Logger)
            and (lg.handlers or not lg.propagate)]


def make_cache(arm: str, model, max_len: int):
    if arm == "static":
        return transformers.StaticCache(config=model.config, max_cache_len=max_len)
    return kh.KVTaxCache(model.config, kv=arm.split("-", 1)[1], max_cache_len=max_len)


def counters_snapshot() -> dict:
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items() if v and k in (
        "stats", "recompiles", "graph_break", "inductor", "frames", "aot_autograd")}


def profile_arm(model, arm: str, args, device: torch.device, logs: LogLines) -> dict:
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    counters.clear()
    logs.lines.clear()
    n_new = args.warmup_steps + args.steps + 1
    max_len = args.context + n_new + 1
    cache = make_cache(arm, model, max_len)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, args.context), generator=gen).to(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities, record_shapes=False, with_stack=False)
    probe = StepProbe(device, args.warmup_steps, args.steps, prof)
    cc = transformers.CompileConfig(
        backend=args.backend, mode=None if args.compile_mode == "none" else args.compile_mode,
        fullgraph=False,
    )
    cc._compile_all_devices = device.type != "cuda"  # CPU compiles only when asked
    kw: dict = dict(compile_config=cc) if args.compile_mode != "none" else dict(disable_compile=True)
    installed = arm.startswith("kvtax-")
    if installed:
        kh.install(model)
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if args.first_generate:  # hf_decode.py's pattern: warm-up generate, reset, again
                model.generate(
                    ids, attention_mask=torch.ones_like(ids),
                    max_new_tokens=args.first_generate, min_new_tokens=args.first_generate,
                    do_sample=False, pad_token_id=0, **{cache_kwarg(model): cache}, **kw,
                )
                cache.reset()
                row_first = dict(logs_after_first=list(dict.fromkeys(logs.lines))[:30])
            else:
                row_first = {}
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                min_new_tokens=n_new, do_sample=False, pad_token_id=0,
                logits_processor=LogitsProcessorList([probe]), **{cache_kwarg(model): cache},
                **kw,
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        row = summarize(arm, probe, prof, device)
        row.update(row_first, first_generate=args.first_generate)
        row["generate_s"] = time.perf_counter() - t0
        if installed:
            row["op_us_per_call"] = op_costs(cache, model, device)
    finally:
        if installed:
            kh.uninstall(model)
    row["counters"] = counters_snapshot()
    row["log_lines"] = list(dict.fromkeys(logs.lines))[:60]
    if args.trace and args.out:
        path = pathlib.Path(args.out) / f"trace_{arm}.json"
        prof.export_chrome_trace(str(path))
        with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
            dst.write(src.read())
        path.unlink()
    del cache
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return row


def summarize(arm: str, probe: StepProbe, prof, device: torch.device) -> dict:
    """Per-step times from the probe's marks; kernels and launch calls from the profile."""
    marks = probe.marks
    n = len(marks) - 1
    row: dict = {"arm": arm, "steps": n}
    if n < 1:
        row["error"] = "generate ended before the profiled steps"
        return row
    host = [1e3 * (b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    cpu = [1e3 * (b[2] - a[2]) for a, b in zip(marks, marks[1:])]
    row["host_ms_per_step"] = statistics.median(host)
    row["process_cpu_ms_per_step"] = statistics.median(cpu)
    if probe.cuda:
        wall = [a[0].elapsed_time(b[0]) for a, b in zip(marks, marks[1:])]
        row["wall_ms_per_step"] = statistics.median(wall)
        row["wall_ms_steps"] = [round(w, 3) for w in wall]
    kernels: Counter = Counter()
    kernel_ms: Counter = Counter()
    host_calls: Counter = Counter()
    host_ms: Counter = Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name] += 1
            kernel_ms[ev.name] += ev.device_time / 1e3
        else:
            host_calls[ev.name] += 1
            host_ms[ev.name] += ev.cpu_time_total / 1e3
    row["kernels_per_step"] = sum(kernels.values()) / n
    row["kernel_busy_ms_per_step"] = sum(kernel_ms.values()) / n
    row["launch_calls_per_step"] = sum(host_calls[c] for c in LAUNCH_CALLS) / n
    row["graph_launches_per_step"] = host_calls["cudaGraphLaunch"] / n
    row["cuda_syncs_per_step"] = sum(
        host_calls[c] for c in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                "cudaEventSynchronize")) / n
    row["top_kernels"] = [
        {"name": name[:120], "ms_per_step": ms / n, "calls_per_step": kernels[name] / n}
        for name, ms in kernel_ms.most_common(TOP)
    ]
    row["kvtax_ops"] = {
        name: {"calls_per_step": host_calls[name] / n, "host_ms_per_step": host_ms[name] / n}
        for name in ("kvtax::attention", "kvtax::quantize_store") if host_calls[name]
    }
    return row


def op_costs(cache, model, device: torch.device, calls: int = 200) -> dict:
    """Host microseconds per call of the two kvtax custom ops on layer 0's storage, as a
    compiled graph calls them (dispatcher, op body, Triton launches); no sync inside."""
    from kvtax.attention import triton_api  # noqa: F401 (registers kvtax::attention)
    from kvtax.formats import store_triton  # noqa: F401 (registers kvtax::quantize_store)

    layer = cache.layers[0]
    pos = layer.positions
    if device.type != "cuda" or pos is None or pos.view is None:
        return {"skipped": "the kernels serve CUDA tensors only"}
    cfg = model.config
    view, store = pos.view, layer.cache.store
    q = torch.randn(1, cfg.num_attention_heads, 1, view.head_dim, dtype=view.dtype, device=device)
    k = torch.randn(1, cfg.num_key_value_heads, 1, view.head_dim, dtype=view.dtype, device=device)
    spec = view.spec.name
    window = -1 if view.window is None else view.window
    # the slot after the last token: generation is over, nothing reads it again
    pos_t = pos.pos_t.clone()

    def attention():
        torch.ops.kvtax.attention.default(
            q, *view.k, *view.v, pos.len_t, None, spec, view.head_dim, view.length,
            view.sinks, view.ring, window, view.dtype, -1.0, 0.0)

    def store_one():
        torch.ops.kvtax.quantize_store.default(
            k, k, *store.k, *store.v, spec, pos_t, 0, view.sinks, view.ring, False)

    out = {}
    for name, fn in (("kvtax::attention", attention), ("kvtax::quantize_store", store_one)):
        try:
            for _ in range(10):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            host = (time.perf_counter() - t) / calls * 1e6
            if device.type == "cuda":
                torch.cuda.synchronize()
            out[name] = round(host, 1)
        except Exception as exc:  # report, do not lose the arm
            out[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def report(rows: list[dict], env: dict) -> str:
    lines = [f"# hf_profile: {json.dumps(env)}", ""]
    for r in rows:
        lines.append(f"## {r['arm']}  ({r.get('generate_s', 0):.1f} s generate)")
        if "error" in r:
            lines.append(f"  error: {r['error']}")
        for key in ("wall_ms_per_step", "host_ms_per_step", "process_cpu_ms_per_step",
                    "kernel_busy_ms_per_step", "kernels_per_step", "launch_calls_per_step",
                    "graph_launches_per_step", "cuda_syncs_per_step"):
            if key in r:
                lines.append(f"  {key:26s} {r[key]:10.3f}")
        if r.get("wall_ms_steps"):
            lines.append(f"  wall ms per step: {r['wall_ms_steps']}")
        for name, v in r.get("kvtax_ops", {}).items():
            lines.append(f"  {name}: {v['calls_per_step']:.0f} calls/step, "
                         f"{v['host_ms_per_step']:.3f} host ms/step (profiled)")
        if "op_us_per_call" in r:
            lines.append(f"  op host us/call (no CUDA graph): {r['op_us_per_call']}")
        lines.append("  top CUDA kernels (ms/step, calls/step):")
        for k in r.get("top_kernels", []):
            lines.append(f"    {k['ms_per_step']:8.3f} {k['calls_per_step']:6.1f}  {k['name']}")
        lines.append(f"  counters: {json.dumps(r.get('counters', {}), default=str)[:1500]}")
        lines.append(f"  log lines ({len(r.get('log_lines', []))}):")
        lines.extend(f"    {line}" for line in r.get("log_lines", []))
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--config", choices=("llama31-8b", "tiny"), default="llama31-8b")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--arms", default="static,kvtax-int8", help=f"comma list of {ARMS}")
    p.add_argument("--compile-mode", default="reduce-overhead",
                   help="torch.compile mode (reduce-overhead: CUDA graphs; default; none: eager)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--warmup-steps", type=int, default=5,
                   help="decode steps before profiling (compile, CUDA-graph warm-up + record)")
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    p.add_argument("--first-generate", type=int, default=0, metavar="N",
                   help="first run a generate of N new tokens on the same cache and reset it, "
                        "as hf_decode.py's warm-up does, then profile the second generate "
                        "(hf_decode.py measured kvtax int8 compiled at 29 ms/token where this "
                        "script's single generate gave 11.9 ms/step; default 0: one generate)")
    p.add_argument("--out", default=None, help="output folder")
    p.add_argument("--trace", action="store_true", help="also write gzip'd Chrome traces")
    args = p.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in args.arms if a not in ARMS]
    if bad:
        p.error(f"unknown arms {bad}; choose from {ARMS}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    out = pathlib.Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    torch._logging.set_logs(recompiles=True, graph_breaks=True, cudagraphs=True, perf_hints=True)
    logs = LogLines()  # after set_logs, which resets the handlers of torch's loggers
    hooked = _torch_loggers()
    for lg in hooked:
        lg.addHandler(logs)
    t0 = time.perf_counter()
    cfg = llama31_8b_config() if args.config == "llama31-8b" else tiny_config("llama", vocab=1024)
    with device:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__,
           "config": args.config, "context": args.context, "compile_mode": args.compile_mode,
           "backend": args.backend, "warmup_steps": args.warmup_steps, "steps": args.steps}
    print(f"[hf_profile] model built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = []
    for arm in args.arms:
        t = time.perf_counter()
        try:
            row = profile_arm(model, arm, args, device, logs)
        except Exception as exc:  # one failing arm must not lose the others
            import traceback

            row = {"arm": arm, "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                   "traceback": traceback.format_exc()[-3000:], "log_lines": logs.lines[:60]}
            torch._dynamo.reset()
        row["arm_s"] = time.perf_counter() - t
        rows.append(row)
        print(f"[hf_profile] {arm}: {time.perf_counter() - t:.0f} s, "
              f"{row.get('wall_ms_per_step', row.get('host_ms_per_step', float('nan'))):.2f} "
              f"ms/step", file=sys.stderr, flush=True)
        if out:  # every finished arm is on disk even if a later one is killed
            (out / "summary.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1,
                                                         default=str))
            (out / "summary.txt").write_text(report(rows, env) + "\n")
    for lg in hooked:
        lg.removeHandler(logs)
    print(report(rows, env))
    return rows


if __name__ == "__main__":
    main()
