"""Triton kernels for attention over quantized KV (`@triton.jit` code only).

- `dequant`: load one tile of K or V slots in any storage format and dequantize it in
  registers, as two half-width tiles (dims `[0, D/2)` and `[D/2, D)`, int4's split halves).
- `common`: the slot → position map, visibility, and one online-softmax step.
- `prefill`: a block of query rows (GQA heads packed into M) against the whole cache.
- `decode`: 1..16 query rows, split-KV partials; `reduce` merges the splits.

Nothing here checks its inputs: `kvtax.attention.triton_api` does, then launches.
"""
