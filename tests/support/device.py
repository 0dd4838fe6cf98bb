"""What this machine offers the tests: CUDA, Triton, and the device kernel tests use."""

from __future__ import annotations

import torch

HAS_CUDA = torch.cuda.is_available()
try:  # an import, not find_spec: a blocked install (sys.modules["triton"] = None) counts as absent
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
# Kernel tests run on the GPU when there is one, else on CPU tensors (interpreted kernels).
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
