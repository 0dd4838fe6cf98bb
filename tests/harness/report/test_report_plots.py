"""Figures people can read: axes from 0, byte units by magnitude, model/device/date in the
titles, one style per arm, the bytes-predicted decode lines and the break-even plot."""

from __future__ import annotations

import pytest

from kvtax.harness.report import plots
from kvtax.harness.analysis.analyze import summarize
from kvtax.harness.analysis.verdict import verdict
from tests.support.rows import GPU, GPU_CTX, H200, WEIGHTS, planted_rows

pytest.importorskip("matplotlib")


@pytest.fixture()
def figs(monkeypatch):
    """Capture each figure instead of writing it."""
    got = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: got.append(fig) or path)
    return got


def _analysis():
    a = summarize(planted_rows(GPU, GPU_CTX))
    a["meta"] = {"model": "llama-3.1-8b", "device": "NVIDIA H200", "date": "2026-12-01",
                 "memory_kind": "cuda_allocated"}
    a["cache_bytes"] = {arm: {c: c * GPU[arm][3] // 1000 for c in GPU_CTX} for arm in GPU}
    return a


def test_byte_unit_fits_the_values():
    assert plots.byte_unit([500 * 2**10, 3 * 2**20]) == ("MiB", 2**20)
    assert plots.byte_unit([5e4]) == ("KiB", 2**10)
    assert plots.byte_unit([2.5 * 2**30]) == ("GiB", 2**30)
    assert plots.byte_unit([]) == ("B", 1)


def test_decode_plot_axes_titles_and_predicted_lines(tmp_path, figs):
    a = _analysis()
    plots.decode_plot(a, tmp_path / "d.png")
    ax = figs[0].axes[0]
    assert ax.get_ylim()[0] == 0 and ax.get_xlim()[0] == 0
    assert "llama-3.1-8b · NVIDIA H200 · 2026-12-01" in ax.get_title()
    # fp16/fp16, int8/fused, int4/fused: baseline slope x bytes ratio, from each arm's t0.
    drawn = [ln for ln in ax.get_lines() if (ln.get_gid() or "").startswith("predicted")]
    assert sorted(ln.get_gid() for ln in drawn) == [
        "predicted fp16/fp16", "predicted int4/fused", "predicted int8/fused"]
    m = a["fits"]["fp16/fused"]["m"] * GPU["int4/fused"][3] / GPU["fp16/fused"][3]
    t0 = a["fits"]["int4/fused"]["t0"]
    assert any(ln.get_ydata()[1] == pytest.approx(t0 + m * 131072) for ln in drawn)
    styles = {(ln.get_marker(), ln.get_linestyle()) for ln in ax.get_lines()
              if ln.get_label() in GPU or ln.get_label().startswith("fp16/fused")}
    assert len(styles) == len(GPU), "each arm keeps a distinct marker / line style"


def test_memory_plot_units_per_panel(tmp_path, figs):
    plots.memory_plot(_analysis(), tmp_path / "m.png")
    axes = figs[0].axes
    assert [ax.get_ylabel() for ax in axes] == ["GiB", "GiB", "MiB"]
    assert all(ax.get_ylim()[0] == 0 for ax in axes)


def test_break_even_plot_crosses(tmp_path, figs):
    a = _analysis()
    v = verdict(a, H200, weight_bytes=WEIGHTS)
    plots.break_even_plot(v, a, tmp_path / "b.png")
    ax = figs[0].axes[0]
    lines = {ln.get_label().split(" ")[0]: ln for ln in ax.get_lines()}
    fp16, int8 = lines["fp16/fused"].get_ydata(), lines["int8/fused"].get_ydata()
    assert fp16[0] < int8[0] and fp16[-1] > int8[-1], "slower prefill, paid back by decode"
    assert "131,072-token prompt" in ax.get_title()


def test_token_ticks_are_short():
    assert [plots.tokens_label(x) for x in (0, 512, 1536, 131072)] == ["0", "512", "1.5k",
                                                                         "128k"]
