"""Triton kernels of the formats layer (`@triton.jit` code only).

- `quantize`: quantize new K and V rows in any storage format and write them straight
  into their cache slots, in one launch (`kvtax.formats.store_triton` checks and launches).
"""
