"""What this machine offers the tests: CUDA, Triton, and the device kernel tests use."""

from __future__ import annotations

import importlib.util

import torch

HAS_CUDA = torch.cuda.is_available()
# find_spec, not an import: triton's first import must come after tests/conftest.py sets
# TRITON_INTERPRET (its own @jit helpers are built then). ValueError: a blocked install.
try:
    HAS_TRITON = importlib.util.find_spec("triton") is not None
except ValueError:  # sys.modules["triton"] = None, as the no-triton check plays it
    HAS_TRITON = False
# Kernel tests run on the GPU when there is one, else on CPU tensors (interpreted kernels).
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
