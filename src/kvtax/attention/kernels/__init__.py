"""Triton kernels for attention over quantized KV (`@triton.jit` / `@gluon.jit` code only).

- `dequant`: load one tile of K or V slots in any storage format and dequantize it in
  registers, as two half-width tiles (dims `[0, D/2)` and `[D/2, D)`, int4's split halves).
- `common`: the slot → position map, visibility, PDL entry / exit, and one online-softmax
  step of the tile kernels.
- `prefill`: a block of query rows (GQA heads packed into M) against the whole cache.
- `decode`: the tile decode kernel: 1..16 query rows, split-KV partials, any format (the
  only decode kernel for 3-bit codes).
- `decode_warp`: one-warp split-KV decode with the scales folded out of the tiles;
  `warp_tiles` holds its code → fp16 operand loads.
- `decode_swap_gluon`: the swapped decode (slots as the MMA's M) in Gluon, the int8 /
  int4 default on CUDA; `decode_swap` is its Triton twin (the interpreter, soft-capping,
  the shapes Gluon does not take); `swap_asm` the PTX both use.
- `reduce`: merges the decode kernels' split-KV partials.

Nothing here checks its inputs: `kvtax.attention.support` decides which kernel can run,
`kvtax.attention.launch` launches it.
"""
