"""What this machine offers the tests: CUDA, Triton, and the device kernel tests use."""

from __future__ import annotations

import importlib.util

import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
# Kernel tests run on the GPU when there is one, else on CPU tensors (interpreted kernels).
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
