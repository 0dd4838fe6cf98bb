"""Builds the decode-GEMV kernels interpreted on a machine without CUDA.

As tests/kernels_env.py does for the attention kernels: the kernel module and its API are
(re)imported with TRITON_INTERPRET=1, then the variable is restored; kernel test modules
also import kernels_env's autouse `interpret_mode` fixture, which sets it while a test runs.
"""

from __future__ import annotations

import importlib
import os
import sys

from tests import kernels_env as ke

if not ke.HAS_CUDA:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for _name in ("kvtax.models.kernels.gemv", "kvtax.models.gemv"):
            if _name in sys.modules:
                importlib.reload(sys.modules[_name])
            else:
                importlib.import_module(_name)
    finally:
        if _saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _saved
