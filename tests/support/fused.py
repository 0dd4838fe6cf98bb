"""Hold a hybrid-cache attention call to its fused path: force the kernels (CPU: Triton's
interpreter), count Triton launches by kind, and make the per-part path (`part_attention`,
`merge_lse`) raise, so a silent fallback fails the test instead of passing on the torch path."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvtax.attention import dispatch as dispatch_mod
from tests.support import kernels as ke


def fused_only(monkeypatch, kernels: Mapping[str, Iterable]) -> dict[str, int]:  # noqa: ANN001
    """`kernels`: launch kind → the `@triton.jit` functions whose launches count as it.
    Returns the counts, updated as the test runs."""
    counts = {kind: 0 for kind in kernels}
    for kind, fns in kernels.items():
        for fn in fns:
            original = fn.run
            monkeypatch.setattr(fn, "run", lambda *a, _k=kind, _o=original, **kw: counts.__setitem__(
                _k, counts[_k] + 1) or _o(*a, **kw))
    if not ke.HAS_CUDA:
        monkeypatch.setattr(dispatch_mod, "kernel_unavailable", lambda *a: None)

    def boom(*a, **k):
        raise AssertionError("the per-part path ran")

    monkeypatch.setattr(dispatch_mod, "part_attention", boom)
    monkeypatch.setattr(dispatch_mod, "merge_lse", boom)
    return counts
