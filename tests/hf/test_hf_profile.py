"""benchmarks/hf_profile.py run as a script on a toy model on the CPU, and the sampled
mask-pattern probe the kvtax mask function runs every eager step."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import masking_utils as mu

from kvtax.hf.attention import _check_pattern, _probe_keys
from tests.support.scripts import run_benchmark


def test_tiny_cpu_profile_writes_a_summary(tmp_path) -> None:
    run = run_benchmark("hf_profile.py", "--device", "cpu", "--config", "tiny", "--context",
                        "40", "--compile-mode", "none", "--warmup-steps", "1", "--steps", "3",
                        "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert [r["arm"] for r in rows] == ["static", "kvtax-int8"]
    for r in rows:
        assert "error" not in r, r.get("traceback")
        assert r["steps"] == 3 and r["host_ms_per_step"] > 0
    text = (tmp_path / "summary.txt").read_text()
    assert "## static" in text and "## kvtax-int8" in text and "top CUDA kernels" in text
    assert len(rows) == 2


@pytest.mark.parametrize("offset", [0, 5000, 40000, None], ids=["o0", "o5k", "o40k", "device"])
def test_sampled_probe_accepts_causal_and_window_and_rejects_others(offset) -> None:
    for q_len in (1, 7, 3000):
        _check_pattern(mu.causal_mask_function, q_len, offset, None)
        _check_pattern(mu.sliding_window_causal_mask_function(37), q_len, offset, 37)
        if (offset if offset is not None else 128) + q_len <= 38:
            continue  # no query is far enough from key 0 for a window of 37 to show
        with pytest.raises(NotImplementedError):  # a window the cache does not apply
            _check_pattern(mu.sliding_window_causal_mask_function(37), q_len, offset, None)
        with pytest.raises(NotImplementedError):  # a different window
            _check_pattern(mu.sliding_window_causal_mask_function(36), q_len, offset, 37)
        if q_len == 1:
            continue  # one query (the newest token) has no later key to see
        with pytest.raises(NotImplementedError):  # bidirectional
            _check_pattern(lambda b, h, q, k: torch.ones_like(q - k, dtype=torch.bool), q_len,
                           offset, None)
    if offset is not None and offset >= 5000:  # chunks of 4096 keys: earlier chunks hidden
        with pytest.raises(NotImplementedError):
            _check_pattern(lambda b, h, q, k: (k <= q) & (k // 4096 == q // 4096), 1, offset,
                           None)


def test_probe_keys_are_few_sorted_and_in_range() -> None:
    rows = torch.tensor([40000, 40100])
    keys = _probe_keys(rows, 40101, 512)
    assert keys.numel() < 600 and torch.equal(keys, keys.sort().values)
    assert int(keys.min()) == 0 and int(keys.max()) == 40100
    assert {40000 - 512, 40000 - 511, 40100} <= set(keys.tolist())
    assert torch.equal(_probe_keys(rows[:1], 100, None), torch.arange(100))
