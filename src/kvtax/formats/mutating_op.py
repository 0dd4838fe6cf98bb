"""Register a Triton launch as an opaque `kvtax::` op that writes its arguments in place.

torch.compile then sees one op that mutates the tensors its schema marks `(aN!)`: Inductor
re-specializes user Triton kernels it traces and failed to build the store kernel on the
H200 (Triton 3.6, transformers' compiled generate). The op uses torch.library's plain API,
not `torch.library.custom_op`: the latter's ADInplaceOrView kernel for a mutating op
re-fills the schema's defaults on every call (~150 us of host time per call, measured on
CPU; a compiled decode step without CUDA graphs calls it once per layer). Inference only:
no autograd formula, and in-place writes do not bump version counters.

    >>> _op = mutating_op("block0_order(Tensor buf, Tensor pos_t, Tensor(a2!) order) -> ()",
    ...                   _launch)
    >>> _op(buf, pos_t, order)        # inside a compiled region
"""

from __future__ import annotations

from typing import Callable

import torch

_LIBS: list[torch.library.Library] = []  # a Library unregisters its ops when collected


def mutating_op(schema: str, body: Callable[..., None]) -> Callable[..., None]:
    """Define `kvtax::<name>` from `schema` (returning `()`), run by `body` on CPU (Triton's
    interpreter, in tests) and CUDA, with a fake that does nothing; returns the op."""
    name = schema.split("(", 1)[0]
    lib = torch.library.Library("kvtax", "FRAGMENT")
    lib.define(schema)
    for key in ("CPU", "CUDA"):
        lib.impl(name, body, key)
    torch.library.register_fake(f"kvtax::{name}", _nothing, lib=lib)
    _LIBS.append(lib)
    return getattr(torch.ops.kvtax, name).default


def _nothing(*args: object) -> None:
    return None
