"""Compile every kvtax Triton kernel variant for a GPU target without a GPU.

A device call that dies on a compiler error wastes scarce GPU time, and the GPU machine
runs an older Triton (3.6) than CI (newest). This script drives the real wrappers
(triton_attention, the fused cache store) on CPU tensors with Triton's launches turned
into compile-only warm-ups for `--arch` (default sm_90), over the shapes and formats the
tests and benchmarks use, and reports each variant's registers and spills.

    python benchmarks/compile_check.py                       # the installed Triton
    PYTHONPATH=/tmp/t36 python benchmarks/compile_check.py   # e.g. Triton 3.6 unpacked there

Exits 1 if any variant fails to compile. `--dump DIR` writes each compiled variant's PTX
to DIR/<case>#<n>.ptx with kernel symbols and debug lines normalised, so two trees (before
and after a refactor) can be compared with `diff -r`: a rename or a moved line is no change.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import traceback
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

COMPILED: list[tuple[str, object]] = []


def _compile_only(arch: int) -> None:
    """Launches compile for `arch` and return without running (no GPU needed)."""
    target = GPUTarget("cuda", arch, 32)

    class FakeDriver:  # just enough of a CUDA driver for the JIT to compile
        def get_current_target(self):
            return target

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        def map_python_to_cpp_type(self, ty):
            from triton.backends.nvidia.driver import ty_to_cpp
            return ty_to_cpp(ty)

        def __getattr__(self, name):
            raise AttributeError(f"compile-only driver has no {name}")

    driver.set_active(FakeDriver())
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = run


def attention_cases(full: bool):
    """Decode (both kernels) and, with `full`, prefill over the formats and head dims."""
    from kvtax.attention import triton_api as ta
    from kvtax.cache import FullCache, SlidingCache

    specs = ["fp16", "bf16", "int8", "int4", "fp8", "fp8-pt", "k8v4", "int4-g32"]
    grid = [(s, 128, 4, 1, dt, sl) for s in specs for dt in (torch.float16, torch.bfloat16)
            for sl in (False, True)]
    grid += [(s, d, 8, 1, torch.float16, False) for s, d in
             (("int8-g16", 80), ("int4-g32", 96), ("int4", 64), ("int8", 256), ("fp8", 64))]
    if full:
        grid += [(s, 128, 4, n, torch.float16, False) for s in specs for n in (5, 300)]
    for spec, d, group, n_q, dtype, sliding in grid:
        k = torch.randn(1, 2, 300, d, dtype=dtype)
        cache = (SlidingCache(spec, window=128, sinks=4, max_chunk=300) if sliding
                 else FullCache(spec))
        cache.fused_store = False  # the store kernel is checked separately
        cache.append(k, k)
        q = torch.randn(1, 2 * group, n_q, d, dtype=dtype)
        name = f"attn {spec} D{d} G{group} L{n_q} {dtype} sliding={sliding}"
        yield name, lambda q=q, v=cache.view(): ta.triton_attention(q, v)
        if n_q == 1 and dtype == torch.bfloat16 and spec in ("bf16", "int8", "fp8", "int4-g32"):
            # the decode kernel and the reduce launched with PDL (warp / tile kernels)
            yield f"{name} pdl", lambda q=q, v=cache.view(): _with_all_pdl(
                lambda: ta.triton_attention(q, v))


def swap_cases():
    """decode_swap.py (int8 / int4 K and V, one or two groups per row, G * L <= 4)."""
    from kvtax.attention import triton_api as ta
    from kvtax.cache import FullCache

    grid = [(s, 128, 4, 1, dt) for s in ("int8", "int4", "k8v4", "k4v8", "int8-g128")
            for dt in (torch.float16, torch.bfloat16)]
    grid += [("int8", 64, 2, 2, torch.float16), ("int4-g128", 256, 4, 1, torch.bfloat16)]
    for spec, d, group, n_q, dtype in grid:
        k = torch.randn(1, 2, 300, d, dtype=dtype)
        cache = FullCache(spec)
        cache.fused_store = False
        cache.append(k, k)
        q = torch.randn(1, 2 * group, n_q, d, dtype=dtype)
        name = f"swap {spec} D{d} G{group} L{n_q} {dtype}"
        yield name, lambda q=q, v=cache.view(): ta.triton_attention(
            q, v, config=ta.swap_decode_config(q, v))
        if dtype == torch.bfloat16:  # Gluon (int8, int4) or the Triton twin, with PDL
            yield f"{name} pdl", lambda q=q, v=cache.view(): _with_all_pdl(
                lambda: ta.triton_attention(q, v, config=ta.swap_decode_config(q, v)))


def c64_swap_cases():
    """Kernel "swap" over int4-c64 and int4w-c64 keys: the Gluon kernel (int4 g64 values,
    fp16 / bf16, the table's launch and with PDL) and the Triton twin (the other values
    and head dims)."""
    from kvtax.attention import triton_api as ta
    from kvtax.attention.view import CacheView
    from kvtax.formats import KVSpec

    grid = [(f"k4{w}-c64v4", 128, 4, 1, dt) for w in ("", "w")
            for dt in (torch.float16, torch.bfloat16)]
    grid += [("k4-c64v8", 128, 4, 1, torch.float16), ("k4-c64v4", 64, 2, 2, torch.float16),
             ("k4w-c64v4", 64, 2, 2, torch.float16),
             ("k4-c64v4-g128", 256, 4, 1, torch.bfloat16)]
    for spec, d, group, n_q, dtype in grid:
        kv = KVSpec.parse(spec)
        k = torch.randn(1, 2, 320, d, dtype=dtype)
        view = CacheView(kv.key.quantize(k), kv.value.quantize(k), kv, head_dim=d,
                         length=300, dtype=dtype)
        q = torch.randn(1, 2 * group, n_q, d, dtype=dtype)
        name = f"swap {spec} D{d} G{group} L{n_q} {dtype}"
        yield name, lambda q=q, v=view: ta.triton_attention(
            q, v, config=ta.swap_decode_config(q, v))
        if spec in ("k4-c64v4", "k4w-c64v4") and d == 128:
            yield f"{name} pdl", lambda q=q, v=view: _with_all_pdl(
                lambda: ta.triton_attention(q, v, config=ta.swap_decode_config(q, v)))


def hybrid_cases(full: bool):
    """triton_attention_lse over a hybrid cache's parts (kvtax.attention.hybrid): the
    quantized body with the min_distance / min_key masks and the fp16 sink/recent ring,
    both returning the log-sum-exp (decode kernels + reduce; with `full`, prefill)."""
    from kvtax.attention import triton_api as ta
    from kvtax.cache.hybrid import HybridCache

    grid = [(s, d, 1, dt) for s in ("int4-g32+hk@s4r128", "int8@s4r128")
            for d in (64, 128) for dt in (torch.float16, torch.bfloat16)]
    if full:
        grid += [(s, 128, n, torch.float16) for s in ("int4-g32+hk@s4r128", "int8@s4r128")
                 for n in (5, 300)]
    for spec, d, n_q, dtype in grid:
        cache = HybridCache(spec, max_chunk=300)
        for part in cache.parts:
            part.fused_store = False  # the store kernel is checked separately
        k = torch.randn(1, 2, 300, d, dtype=dtype)
        cache.append(k, k)
        q = torch.randn(1, 8, n_q, d, dtype=dtype)
        for i, part in enumerate(cache.view().parts):
            name = f"lse {spec} part{i} D{d} G4 L{n_q} {dtype}"
            yield name, lambda q=q, p=part: ta.triton_attention_lse(
                q, p.view, min_distance=p.min_distance, min_key=p.min_key)
    # q4's fused decode (one shared workspace, one reduce), the body beside the fp16 part
    yield from parts_decode_cases("q4", "q4", torch_store=False)


def parts_decode_cases(spec: str, tag: str, torch_store: bool = True):
    """A hybrid spec's fused decode at D 128, G 4, one row, fp16 and bf16, under PDL: each
    part's split kernel into one shared workspace, one reduce (`launch_parts_decode`).
    torch_store: fill the cache through torch (the store kernel is checked separately)."""
    from kvtax.attention import launch
    from kvtax.cache.hybrid import HybridCache

    for dtype in (torch.float16, torch.bfloat16):
        cache = HybridCache(spec, max_chunk=320)
        if torch_store:
            for part in cache.parts:
                part.fused_store = False
        k = torch.randn(1, 2, 320, 128, dtype=dtype)
        cache.append(k, k)
        q = torch.randn(1, 8, 1, 128, dtype=dtype)
        parts = [(q, p.view, p.min_distance, p.min_key) for p in cache.view().parts]
        yield f"parts {tag} D128 G4 L1 {dtype} pdl", lambda q=q, parts=parts: _with_all_pdl(
            lambda: launch.launch_parts_decode(parts, torch.empty_like(q)))


def staged_cases():
    """The staged prefill (kvtax.attention.staged): the stage kernel per format and dtype,
    then whole staged calls (fp16 chunks with max_key and the prior, the fused edge) on a
    plain int4 cache and q4's body, the scratch shrunk to 128-slot chunks."""
    from kvtax.attention import staged
    from kvtax.attention.stage_launch import launch_stage
    from kvtax.cache import FullCache
    from kvtax.cache.hybrid import HybridCache

    staged.STAGE_BYTES = 1
    for spec, d in (("int8", 128), ("int4", 128), ("fp8", 64), ("k4-c64v4", 128),
                    ("k3-c64v3-g32", 128), ("int4-g16", 80)):
        for dtype in (torch.float16, torch.bfloat16):
            cache = FullCache(spec)
            cache.append(torch.randn(1, 2, 320, d, dtype=dtype),
                         torch.randn(1, 2, 320, d, dtype=dtype))
            v = cache.view()
            out = torch.empty(1, 2, 256, d, dtype=dtype)
            yield f"stage {spec} D{d} {dtype}", lambda v=v, out=out: (
                launch_stage(v.k, v.spec.key, 0, 256, out),
                launch_stage(v.v, v.spec.value, 0, 256, out))
    q = torch.randn(1, 8, 64, 128, dtype=torch.float16)
    cache = FullCache("int4")
    cache.append(torch.randn(1, 2, 320, 128, dtype=torch.float16),
                 torch.randn(1, 2, 320, 128, dtype=torch.float16))
    yield "staged int4 D128 G4 L64", lambda v=cache.view(): staged.staged_launch(
        q, v, out=torch.empty_like(q))
    hyb = HybridCache("q4", max_chunk=320)
    hyb.append(torch.randn(1, 2, 320, 128, dtype=torch.float16),
               torch.randn(1, 2, 320, 128, dtype=torch.float16))
    body = hyb.view().parts[-1] if hyb.view().parts[-1].view.spec.is_quantized else hyb.view().parts[0]
    o32, lse = torch.empty(q.shape), torch.empty(q.shape[:3])
    yield "staged q4 body D128 G4 L64", lambda: staged.staged_launch(
        q, body.view, out=o32, lse=lse, min_distance=body.min_distance, min_key=body.min_key)


def int3_cases(full: bool):
    """3-bit codes on the tile kernels (format codes 5 and 6): q3's body (int3-c64 keys,
    int3-g32 values) at D 64 / 128 / 256 in each query dtype, int3 values or keys beside
    other formats, decode and (with `full`) prefill, and q3's fused hybrid decode."""
    from kvtax.attention import triton_api as ta
    from kvtax.attention.view import CacheView
    from kvtax.cache import FullCache
    from kvtax.formats import ChannelBlockFormat, KVSpec

    grid = [("k3-c64v3-g32", d, dt) for d in (64, 128, 256)
            for dt in (torch.float16, torch.bfloat16, torch.float32)]
    grid += [("k3-c64v8", 128, torch.float16), ("k16v3-g32", 128, torch.bfloat16),
             ("k4v3-g32", 64, torch.float16), ("int3", 128, torch.float16),
             ("int3-g16", 80, torch.float16)]
    for spec, d, dtype in grid:
        kv = KVSpec.parse(spec)
        k = torch.randn(1, 2, 320, d, dtype=dtype)
        if isinstance(kv.key, ChannelBlockFormat):
            view = CacheView(kv.key.quantize(k), kv.value.quantize(k), kv, head_dim=d,
                             length=300, dtype=dtype)
        else:
            cache = FullCache(spec)
            cache.fused_store = False
            cache.append(k, k)
            view = cache.view()
        for n_q in (1, 300) if full else (1,):
            q = torch.randn(1, 8, n_q, d, dtype=dtype)
            yield (f"int3 {spec} D{d} G4 L{n_q} {dtype}",
                   lambda q=q, v=view: ta.triton_attention(q, v))
    yield from parts_decode_cases("q3", "q3")


def widest_cases(full: bool):
    """int4w-c64 keys (format code 7: queries loaded through the channel order, fifth
    bits OR'd into the low nibbles): `k4w-c64v4` at D 64 / 128 / 256 in each query dtype
    through the launch table, the tile decode kernel forced, prefill (with `full`),
    staging, and `k4w-c64v4@s4r128`'s fused hybrid decode."""
    from kvtax.attention import triton_api as ta
    from kvtax.attention.stage_launch import launch_stage
    from kvtax.attention.view import CacheView
    from kvtax.formats import KVSpec

    kv = KVSpec.parse("k4w-c64v4")
    for d in (64, 128, 256):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            k = torch.randn(1, 2, 320, d, dtype=dtype)
            view = CacheView(kv.key.quantize(k), kv.value.quantize(k), kv, head_dim=d,
                             length=300, dtype=dtype)
            for n_q in (1, 300) if full else (1,):
                q = torch.randn(1, 8, n_q, d, dtype=dtype)
                yield (f"widest k4w-c64v4 D{d} G4 L{n_q} {dtype}",
                       lambda q=q, v=view: ta.triton_attention(q, v))
            q = torch.randn(1, 8, 1, d, dtype=dtype)
            yield (f"widest k4w-c64v4 D{d} G4 L1 {dtype} tile",
                   lambda q=q, v=view: ta.triton_attention(q, v, config=ta.tile_decode_config(q, v)))
            out = torch.empty(1, 2, 256, d, dtype=dtype)
            yield f"widest stage D{d} {dtype}", lambda v=view, out=out: launch_stage(
                v.k, v.spec.key, 0, 256, out)
    yield from parts_decode_cases("k4w-c64v4@s4r128", "k4w")


def sweep_cases():
    """benchmarks/attention.py's decode sweep variants (launch options differ)."""
    import attention as bench  # benchmarks/attention.py (the script's folder is on the path)

    from kvtax.attention import triton_api as ta
    from kvtax.cache import FullCache

    for spec in ("int8", "int4", "fp8", "fp16"):
        cache = FullCache(spec)
        cache.fused_store = False
        cache.append(*(torch.randn(1, 8, 4096, 128, dtype=torch.bfloat16),) * 2)
        q = torch.randn(1, 32, 1, 128, dtype=torch.bfloat16)
        for tag in bench.SWEEP_DECODE:
            cfg = bench.sweep_config(tag, q, cache.view(), None)
            yield f"sweep {spec}@{tag}", lambda q=q, v=cache.view(), c=cfg: ta.triton_attention(q, v, config=c)


def store_cases():
    from kvtax.cache import FullCache

    for spec, d, dtype, t in itertools.product(
        ["fp16", "int8", "int4", "fp8", "fp8-pt", "k8v4", "int8-g32", "int4-g16"], [80, 128],
        [torch.float16, torch.bfloat16], [1],
    ):
        group = int(spec.rsplit("-g", 1)[1]) if "-g" in spec else 64
        if spec not in ("fp16", "fp8", "fp8-pt") and d % group:
            continue
        cache = FullCache(spec, capacity=64)
        cache.fused_store = True
        k = torch.randn(1, 2, t, d, dtype=dtype)
        yield f"store {spec} D{d} {dtype} T{t}", lambda c=cache, k=k: c.append(k, k)
        if d == 128 and dtype == torch.bfloat16:
            yield (f"store {spec} D{d} {dtype} T{t} pdl",
                   lambda c=cache, k=k: _with_all_pdl(lambda: c.append(k, k)))
    # int4w-c64's channel order chosen at block 0 (formats/order_triton.py)
    from kvtax.formats import order_triton

    order_triton._interpreting = lambda: True  # let the wrapper take CPU tensors
    for d in (64, 128, 256):
        buf = torch.randn(1, 8, 320, d, dtype=torch.bfloat16)
        order = torch.zeros(1, 8, d, dtype=torch.int64)
        yield (f"store block0 order D{d}",
               lambda b=buf, o=order: order_triton.choose_order(b, torch.tensor([3]), o))
    # a hybrid body's decode write of block-quantized keys (formats/block_store_triton.py)
    from kvtax.formats import block_store_triton

    block_store_triton._interpreting = lambda: True
    for spec, d, dtype, pdl_on in itertools.product(
            ["k4w-c64v4", "k4-c64v4"], [64, 128, 256], [torch.float16, torch.bfloat16],
            [False, True]):
        cache = FullCache(spec, capacity=128)
        cache.fused_store, cache.open_block_read = True, False
        cache.append(*(torch.randn(1, 8, 63, d, dtype=dtype),) * 2)
        k = torch.randn(1, 8, 1, d, dtype=dtype)
        step = (lambda c=cache, k=k: c.write_at(k, k, torch.tensor([63])))
        yield (f"store blocks {spec} D{d} {dtype}{' pdl' if pdl_on else ''}",
               (lambda s=step: _with_all_pdl(s)) if pdl_on else step)


def gemv_cases():
    """kvtax.models.gemv at Llama-3.1-8B decode shapes with each fusion, default (unsplit)
    and split-K configs (the split path adds the reduce kernel)."""
    from kvtax.models import gemv as gm

    gm._interpreting = lambda: True  # let the wrapper take CPU tensors
    k = 4096
    for name, n, fusion in (("qkv", 6144, "norm"), ("qkv", 6144, "norm+bias"),
                            ("qkv", 6144, "norm+rope"), ("qkv", 6144, "norm+bias+rope"),
                            ("qkv", 6144, "norm+rope-freqs"),
                            ("o", 4096, "residual"), ("gate_up", 14336, "silu"),
                            ("gate_up", 10240, "gelu+offset"),
                            ("lm_head", 128256, "norm")):
        for cfg in (None, gm.GemvConfig(8, 512, 4)):
            gated = fusion.startswith(("silu", "gelu"))
            w = torch.randn(2 * n if gated else n, k, dtype=torch.bfloat16)
            x = torch.randn(1, k, dtype=torch.bfloat16)
            kw = dict(norm_weight=torch.ones(k, dtype=torch.bfloat16)) if fusion != "residual" \
                else dict(residual=torch.randn(1, n, dtype=torch.bfloat16))
            if "bias" in fusion:  # Qwen2's qkv
                kw["bias"] = torch.randn(n, dtype=torch.bfloat16)
            if "gelu" in fusion:  # Gemma's MLP
                kw.update(gelu=True, norm_offset=True)
            if "rope" in fusion:  # q and k rotated in the epilogue (32 + 8 heads of 128)
                x = x.view(1, 1, k)
                cs = torch.randn(1, 128, dtype=torch.bfloat16)
                kw["rope"] = (cs, cs.clone(), 40 * 128)
                if "freqs" in fusion:  # the tables built in the kernel from the positions
                    kw["rope"] = (torch.zeros(1, dtype=torch.int64), torch.ones(64), 40 * 128)
            tag = cfg.tag if cfg else "default"
            yield (f"gemv {name} {fusion} {tag}",
                   lambda x=x, w=w, kw=kw, cfg=cfg, s=gated: gm.gemv(
                       x, w, silu_mul=s, config=cfg, **kw))
            if cfg is None:  # the same launch with programmatic dependent launch
                yield (f"gemv {name} {fusion} default pdl",
                       lambda x=x, w=w, kw=kw, s=gated: _with_all_pdl(lambda: gm.gemv(
                           x, w, silu_mul=s, **kw)))


def argmax_cases():
    """kvtax.models.argmax (greedy decoding's one-launch argmax) for each logits dtype."""
    from kvtax.models import argmax as am

    am._interpreting = lambda: True  # let the wrapper take CPU tensors
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, 128256, dtype=dtype)
        yield f"argmax {dtype}", lambda x=x: am.argmax_rows(x)
        # the greedy decode graph's launch: the token into the step's buffer, counters on
        tok, pos = torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        lens = torch.zeros(1, dtype=torch.int32)
        yield (f"argmax {dtype} out+advance",
               lambda x=x, t=tok, p=pos, n=lens: am.argmax_rows(x, out=t, advance=(p, n)))


def _with_all_pdl(fn):  # noqa: ANN001, ANN202
    """Run fn with every kvtax.pdl launch forced on (CPU tensors: it would be off)."""
    from kvtax import pdl

    saved = pdl.enabled
    pdl.enabled = lambda kind, t, interpreting: True
    try:
        return fn()
    finally:
        pdl.enabled = saved


def _normalised_ptx(kernel, name: str) -> str:
    """The kernel's PTX without what a pure refactor changes: its symbol name (and the
    `_param_N` names built from it), comments (their padding follows the name's length),
    source file / line directives and debug sections."""
    import re

    ptx = kernel.asm.get("ptx", "")
    ptx = ptx.split(".section\t.debug", 1)[0].split(".section .debug", 1)[0]
    ptx = re.sub(rf"\b{re.escape(name)}(?=\b|_param)", "KERNEL", ptx)
    lines = (re.sub(r"\s*//.*$", "", ln).rstrip() for ln in ptx.splitlines())
    return "\n".join(ln for ln in lines
                     if ln and not ln.lstrip().startswith((".loc", ".file", "$L__func")))


def _dump_name(case: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", case).strip("_")


def _resources(kernel) -> str:
    """Registers / spill stack / static shared memory of a compiled kernel (cuobjdump)."""
    import os
    import re
    import subprocess
    import tempfile

    cubin = kernel.asm.get("cubin")
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", out))
    return (f"regs={found.get('REG', '?')} stack={found.get('STACK', '?')} "
            f"smem={kernel.metadata.shared}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--only", choices=["attention", "int3", "widest", "staged", "swap", "sweep",
                                      "store", "gemv", "parts"],
                   default=None)
    p.add_argument("--full", action="store_true", help="also the prefill path")
    p.add_argument("-v", action="store_true", help="print tracebacks")
    p.add_argument("--dump", type=Path, default=None, metavar="DIR",
                   help="write each case's normalised PTX to DIR/<case>#<n>.ptx")
    args = p.parse_args()
    _compile_only(args.arch)
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    from kvtax.attention import launch

    checks = launch.unsupported_reason
    launch.unsupported_reason = lambda q, view, allow_cpu=False: checks(q, view, allow_cpu=True)
    from kvtax.formats import store_triton

    store_triton._interpreting = lambda: True  # let the store wrapper take CPU tensors
    failed = 0
    cases = []
    if args.only in (None, "attention"):
        cases += list(attention_cases(args.full))
        cases += list(hybrid_cases(args.full))
        cases += list(swap_cases())
        cases += list(c64_swap_cases())
    if args.only in (None, "attention", "int3"):
        cases += list(int3_cases(args.full))
    if args.only in (None, "attention", "widest"):
        cases += list(widest_cases(args.full))
    if args.only in (None, "attention", "staged"):
        cases += list(staged_cases())
    if args.only == "swap":
        cases += list(swap_cases())
        cases += list(c64_swap_cases())
    if args.only == "parts":  # q4's fused decode alone (a quick check of that launch)
        cases += list(parts_decode_cases("q4", "q4", torch_store=False))
    if args.only in (None, "sweep"):
        cases += list(sweep_cases())
    if args.only in (None, "store"):
        cases += list(store_cases())
    if args.only in (None, "gemv"):
        cases += list(gemv_cases())
        cases += list(argmax_cases())
    seen = set()
    for name, fn in cases:
        COMPILED.clear()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report every failing variant
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            if args.v:
                traceback.print_exc()
            continue
        for n, (kname, k) in enumerate(COMPILED):
            if args.dump is not None:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{_dump_name(name)}#{n}.ptx").write_text(_normalised_ptx(k, kname))
            key = (kname, k.hash if hasattr(k, "hash") else id(k))
            if key in seen:
                continue
            seen.add(key)
            print(f"ok   {name}: {kname} {_resources(k)}", flush=True)
    print(f"{len(cases) - failed}/{len(cases)} cases compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
