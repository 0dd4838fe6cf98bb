"""Warp-specialized decode-attention prototype in Gluon (compile-only check for sm_90).

NOT PART OF KVTAX: a feasibility probe from session 8 (notes/KERNELS.md), kept for the
next attempt at issue 3. It was compiled for sm_90 with Triton 3.6 and 3.9 through
benchmarks/compile_check.py's compile-only driver and NEVER RUN: its mbarrier phases,
data flow and results are unchecked, and it computes no real attention output.

Producer partition (1 warp): streams [BLOCK_N, D] uint8 K and V code tiles plus per-slot
fp32 scales into a STAGES-deep shared-memory ring with cp.async (or TMA), signalling
`ready[s]` mbarriers; waits on `empty[s]` before reusing a stage.
Default partition (consumer, num_warps warps): waits on ready[s], loads the uint8 tiles
straight into mma_v2 dot-operand layouts, converts int8 codes -> fp16 with the 0x6400
trick, QK^T via mma_v2, online softmax (exp2), P@V via mma_v2, arrives on empty[s].

Usage:  python ws_decode_prototype.py [cpasync|tma] [consumer_warps]
        PYTHONPATH=/tmp/t36 python ws_decode_prototype.py ...
"""
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

# ---- version bridge (3.6 vs 3.9) ---------------------------------------------------------
# cp.async global->shared: 3.6 `async_copy_global_to_shared`; 3.9 renamed `async_load`
# (the old name still exists in 3.9 but raises RuntimeError).
if hasattr(async_copy, "async_load"):
    cp_async_load = async_copy.async_load
else:
    cp_async_load = async_copy.async_copy_global_to_shared
# TMA global->shared: 3.6 `tma.async_copy_global_to_shared`; 3.9 `tma.async_load`.
if hasattr(tma, "async_load"):
    tma_load = tma.async_load
else:
    tma_load = tma.async_copy_global_to_shared

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
import compile_check as cc  # noqa: E402


@gluon.jit
def _producer(k_ptr, v_ptr, ks_ptr, vs_ptr, k_desc, v_desc,
              k_smem, v_smem, ks_smem, vs_smem, ready, empty, n_tiles,
              D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              USE_TMA: gl.constexpr):
    # one warp: 16 B per thread per cp.async, 4 rows x 128 B per pass, 8 passes for 32 rows
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [1, 1], [1, 0])
    sl: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])  # 32 fp32 scales, 4 B each
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    srow = gl.arange(0, BLOCK_N, layout=sl)
    for i in range(n_tiles):
        s = i % STAGES
        ph = (i // STAGES) & 1
        # wait until the consumer has released this stage (first pass: parity 1 is "done")
        mbarrier.wait(empty.index(s), ph ^ 1)
        base = i * BLOCK_N
        if USE_TMA:
            # scales by cp.async (a [32] fp32 TMA box would also do); their (incrementing)
            # arrive goes first so the phase cannot complete before they land
            cp_async_load(ks_smem.index(s), ks_ptr + base + srow)
            cp_async_load(vs_smem.index(s), vs_ptr + base + srow)
            async_copy.mbarrier_arrive(ready.index(s))
            # arrive.expect_tx (counts as the single arrival) + two TMA tile loads
            mbarrier.expect(ready.index(s), 2 * BLOCK_N * D)
            tma_load(k_desc, [base, 0], ready.index(s), k_smem.index(s))
            tma_load(v_desc, [base, 0], ready.index(s), v_smem.index(s))
        else:
            offs = (base + rows)[:, None] * D + cols[None, :]
            cp_async_load(k_smem.index(s), k_ptr + offs)
            cp_async_load(v_smem.index(s), v_ptr + offs)
            cp_async_load(ks_smem.index(s), ks_ptr + base + srow)
            cp_async_load(vs_smem.index(s), vs_ptr + base + srow)
            # arrive on ready[s] when this thread's outstanding cp.asyncs land
            async_copy.mbarrier_arrive(ready.index(s))
            # plus one ordinary arrival (count=1) so the phase cannot complete early
            mbarrier.arrive(ready.index(s))


@gluon.jit
def _int8_to_f16(x):
    # codes are uint8 (offset-binary); 0x6400 | x is fp16 1024 + x
    return (x.to(gl.uint16) | 0x6400).to(gl.float16, bitcast=True) - 1152.0


@gluon.jit
def _consumer(q_ptr, o_ptr, k_smem, v_smem, ks_smem, vs_smem, ready, empty, n_tiles, qk_scale,
              D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              BLOCK_M: gl.constexpr, CWARPS: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, CWARPS],
                                                  instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)

    qm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_l))
    qd = gl.arange(0, D, layout=gl.SliceLayout(0, a_l))
    q = gl.load(q_ptr + qm[:, None] * D + qd[None, :])  # [16, D] fp16, A operand

    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_l)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_l)
    acc = gl.zeros([BLOCK_M, D], gl.float32, mma)
    for i in range(n_tiles):
        s = i % STAGES
        ph = (i // STAGES) & 1
        mbarrier.wait(ready.index(s), ph)
        # K tile [BLOCK_N, D] in smem -> B operand [D, BLOCK_N] (permuted view)
        kc = k_smem.index(s).permute((1, 0)).load(b_l)
        kt = _int8_to_f16(kc)
        vc = v_smem.index(s).load(b_l)  # [BLOCK_N, D] B operand of P@V
        vt = _int8_to_f16(vc)
        ks = ks_smem.index(s).load(col_l)
        vs = vs_smem.index(s).load(gl.SliceLayout(1, gl.BlockedLayout([1, 1], [32, 1], [1, CWARPS], [0, 1])))
        # release the stage as soon as all its data is in registers
        mbarrier.arrive(empty.index(s))

        sc = mma_v2(q, kt, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma))
        sc = sc * (ks * qk_scale)[None, :]
        m_new = gl.maximum(m_i, gl.max(sc, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * alpha[:, None]
        # V scales are per slot = per K-row of P@V: fold into P's columns
        p = p * gl.convert_layout(vs, col_l)[None, :]
        pa = gl.convert_layout(p.to(gl.float16), a_l)
        acc = mma_v2(pa, vt, acc)
        m_i = m_new
    acc = acc / l_i[:, None]
    om = gl.arange(0, BLOCK_M, layout=row_l)
    od = gl.arange(0, D, layout=col_l)
    gl.store(o_ptr + om[:, None] * D + od[None, :], acc.to(gl.float16))


@gluon.jit
def ws_decode_kernel(q_ptr, o_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, k_desc, v_desc, n_tiles, qk_scale,
                     D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     BLOCK_M: gl.constexpr, USE_TMA: gl.constexpr, WORKER_REGS: gl.constexpr):
    CWARPS: gl.constexpr = gl.num_warps()
    if USE_TMA:
        smem_l: gl.constexpr = k_desc.layout
    else:
        smem_l: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    sc_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    k_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D], smem_l)
    v_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D], smem_l)
    ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], sc_l)
    vs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], sc_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()  # make the inits visible to the async proxy (TMA) before use
    if WORKER_REGS is None:  # 3.9 only: worker_num_regs optional (no setmaxnreg)
        gl.warp_specialize(
            [(_consumer, (q_ptr, o_ptr, k_smem, v_smem, ks_smem, vs_smem, ready, empty, n_tiles, qk_scale,
                          D, BLOCK_N, STAGES, BLOCK_M, CWARPS)),
             (_producer, (k_ptr, v_ptr, ks_ptr, vs_ptr, k_desc, v_desc, k_smem, v_smem, ks_smem, vs_smem,
                          ready, empty, n_tiles, D, BLOCK_N, STAGES, USE_TMA))],
            [1],
        )
    else:
        gl.warp_specialize(
            [(_consumer, (q_ptr, o_ptr, k_smem, v_smem, ks_smem, vs_smem, ready, empty, n_tiles, qk_scale,
                          D, BLOCK_N, STAGES, BLOCK_M, CWARPS)),
             (_producer, (k_ptr, v_ptr, ks_ptr, vs_ptr, k_desc, v_desc, k_smem, v_smem, ks_smem, vs_smem,
                          ready, empty, n_tiles, D, BLOCK_N, STAGES, USE_TMA))],
            [1],
            [WORKER_REGS],
        )


@gluon.jit
def _idle():
    pass


@gluon.jit
def ws_decode_kernel_w(q_ptr, o_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, k_desc, v_desc, n_tiles, qk_scale,
                       D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       BLOCK_M: gl.constexpr, USE_TMA: gl.constexpr, WORKER_REGS: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr):
    """Variant: the consumer is a 1-warp *worker* partition; the default partition
    (num_warps=4, the minimum) does nothing."""
    if USE_TMA:
        smem_l: gl.constexpr = k_desc.layout
    else:
        smem_l: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    sc_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    k_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D], smem_l)
    v_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D], smem_l)
    ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], sc_l)
    vs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], sc_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [(_idle, ()),
         (_consumer, (q_ptr, o_ptr, k_smem, v_smem, ks_smem, vs_smem, ready, empty, n_tiles, qk_scale,
                      D, BLOCK_N, STAGES, BLOCK_M, 1)),
         (_producer, (k_ptr, v_ptr, ks_ptr, vs_ptr, k_desc, v_desc, k_smem, v_smem, ks_smem, vs_smem,
                      ready, empty, n_tiles, D, BLOCK_N, STAGES, USE_TMA))],
        [1, 1],
        [CONSUMER_REGS, WORKER_REGS],
    )


def main():
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="cpasync", choices=["cpasync", "tma"])
    ap.add_argument("cwarps", nargs="?", type=int, default=4)
    ap.add_argument("--regs", type=int, default=24, help="producer setmaxnreg; 0 = omit (3.9 only)")
    ap.add_argument("--worker-consumer", action="store_true",
                    help="1-warp consumer as a worker partition, idle 4-warp default partition")
    ap.add_argument("--consumer-regs", type=int, default=232)
    a = ap.parse_args()
    mode, cwarps = a.mode, a.cwarps
    cc._compile_only(90)
    D, BLOCK_N, STAGES, BLOCK_M, n = 128, 32, 3, 16, 4096
    q = torch.randn(BLOCK_M, D, dtype=torch.float16)
    o = torch.empty_like(q)
    k = torch.randint(0, 255, (n, D), dtype=torch.uint8)
    v = torch.randint(0, 255, (n, D), dtype=torch.uint8)
    ks = torch.rand(n, dtype=torch.float32)
    vs = torch.rand(n, dtype=torch.float32)
    use_tma = mode == "tma"
    if use_tma:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        lay = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.uint8)
        k_desc = TensorDescriptor.from_tensor(k, [BLOCK_N, D], lay)
        v_desc = TensorDescriptor.from_tensor(v, [BLOCK_N, D], lay)
    else:
        k_desc = v_desc = None
    regs = a.regs or None
    if a.worker_consumer:
        ws_decode_kernel_w[(1,)](q, o, k, v, ks, vs, k_desc, v_desc, n // BLOCK_N, 0.088,
                                 D, BLOCK_N, STAGES, BLOCK_M, use_tma, regs, a.consumer_regs,
                                 num_warps=4)
    else:
        ws_decode_kernel[(1,)](q, o, k, v, ks, vs, k_desc, v_desc, n // BLOCK_N, 0.088,
                               D, BLOCK_N, STAGES, BLOCK_M, use_tma, regs, num_warps=cwarps)
    name, kern = cc.COMPILED[-1]
    sass = _sass(kern)
    print(triton.__version__, mode, f"cwarps={cwarps}", f"worker_consumer={a.worker_consumer}",
          f"wregs={regs}", name, cc._resources(kern), "smem", kern.metadata.shared,
          "reqntid", re.search(r"reqntid (\d+)", kern.asm["ptx"]).group(1),
          "STL", sass.count("STL"), "LDL", sass.count("LDL"),
          "HMMA", sass.count("HMMA"), "LDSM", sass.count("LDSM"))
    tag = f"{triton.__version__}_{mode}_w{cwarps}{'_wc' if a.worker_consumer else ''}_r{regs}"
    for ext in ("ttgir", "ptx"):
        with open(f"/tmp/gluon_proto/out_{tag}.{ext}", "w") as f:
            f.write(kern.asm[ext])


def _sass(kernel):
    import os
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout


if __name__ == "__main__":
    main()
