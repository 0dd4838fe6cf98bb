"""Planted bench rows for the analysis and report tests: every arm linear in context with
chosen slopes, on GPU-like (quantized KV pays off at long context) and CPU-like shapes."""

from __future__ import annotations

from kvtax.harness.schema import PATHS, base_row, make_cell_id, validate_row

GPU_CTX = [4096, 16384, 32768, 65536, 131072]
# arm: (t0 ms, ms per context token, TTFT s per context token, bytes per token)
GPU = {
    "fp16/fused": (4.0, 3.0e-5, 1.0e-4, 131072),
    "fp16/fp16": (4.5, 4.0e-5, 1.1e-4, 131072),    # stock: slower here, not the baseline
    "int8/fused": (4.2, 1.6e-5, 1.2e-4, 69632),
    "int4/fused": (4.4, 0.95e-5, 1.34e-4, 36864),
}
CPU_CTX = [128, 256, 512, 1024]
CPU = {
    "fp16/fused": (10.0, 3.9e-3, 4.0e-4, 2048),
    "fp16/fp16": (10.0, 1.0e-3, 3.0e-4, 2048),     # stock torch SDPA: the best fp16
    "int8/fused": (10.5, 1.0e-3 / 0.98, 4.0e-4, 1152),
    "int4/fused": (10.8, 1.0e-3 / 0.82, 4.5e-4, 640),
    "int8/dequant": (10.2, 2.0e-3, 3.2e-4, 1152),  # beats kvtax's fp16, loses to stock
}
H200 = {"device": "NVIDIA H200", "device_type": "cuda", "gpu_memory_bytes": 150_000_000_000,
        "timestamp": "2026-12-01T20:00:00+00:00"}
WEIGHTS = 16_000_000_000


def planted_rows(arms, contexts, reps=3, model="llama-3.1-8b", weights=WEIGHTS):
    """Valid "ok" rows of `arms` {arm: (t0 ms, ms per context token, TTFT s per context token,
    bytes per token)} at each of `contexts` (tokens), `reps` repetitions 0.2% apart."""
    rows, seq = [], 0
    for arm, (t0, m, ttft_per, bpt) in arms.items():
        kv, path = arm.split("/")
        for ctx in contexts:
            for rep in range(reps):
                params = {"kind": "bench", "model": model, "arm": arm, "context": ctx,
                          "rep": rep, "warmup": False}
                cell = {"cell_id": make_cell_id(params), "seq": seq, "order_seed": 0, "kv": kv,
                        "path": path, **params}
                seq += 1
                row = base_row(cell, run_id="r", device="x", git_commit="abc")
                jitter = 1 + 0.002 * (rep - 1)
                ms, ttft = (t0 + m * ctx) * jitter, ttft_per * ctx * jitter
                row.update(status="ok", ttft_s=ttft, prefill_tok_s=ctx / ttft,
                           prefill_peak_bytes=weights + ctx * bpt, decode_ms_per_token=ms,
                           decode_ms_samples=[ms], decode_peak_bytes=weights + ctx * bpt,
                           decode_growth=False, cache_bytes=ctx * bpt,
                           cache_used_bytes=ctx * bpt, bytes_per_token=bpt,
                           weight_bytes=weights, memory_kind="cuda_allocated")
                if path in PATHS:  # other engines' paths arrive with their schema change
                    validate_row(row)
                rows.append(row)
    return rows
