"""Builds the decode-GEMV kernels interpreted on a machine without CUDA.

As tests/kernels_env.py does for the attention kernels: the kernel module and its API are
(re)imported with TRITON_INTERPRET=1, then the variable is restored; kernel test modules
also import kernels_env's autouse `interpret_mode` fixture, which sets it while a test runs.
"""

from __future__ import annotations

from tests.support import kernels_env as ke

ke.build_interpreted(("kvtax.models.kernels.gemv", "kvtax.models.gemv"))
