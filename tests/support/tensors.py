"""Shared test helpers: one tensor comparison that reports max abs and relative RMS error."""

from __future__ import annotations

import torch


def errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs error, relative RMS error) of `actual` against `expected`, in float64."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    diff = a - e
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    rms = diff.pow(2).mean().sqrt().item() if diff.numel() else 0.0
    ref = e.pow(2).mean().sqrt().item() if e.numel() else 0.0
    return max_abs, rms / max(ref, 1e-30)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float,
    rel_rms: float,
    what: str = "",
) -> None:
    """Fail unless every element is within `atol` and the relative RMS error within `rel_rms`.

    NaN anywhere in `actual` fails (a poisoned output element that was never written).
    """
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not torch.isnan(actual).any(), f"{what}: output holds NaN (unwritten element?)"
    max_abs, rel = errors(actual, expected)
    assert max_abs <= atol and rel <= rel_rms, (
        f"{what}: max abs err {max_abs:.3e} (atol {atol:.1e}), "
        f"rel RMS err {rel:.3e} (bound {rel_rms:.1e})"
    )


def rand_kv(
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    outliers: int = 0,
    gen: torch.Generator | None = None,
) -> torch.Tensor:
    """Gaussian `[..., D]` data; `outliers` channels scaled by 10 (what real keys look like)."""
    x = torch.randn(shape, generator=gen)
    if outliers:
        x[..., :outliers] *= 10.0
    return x.to(dtype)
