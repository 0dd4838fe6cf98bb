"""The README's python snippets run as written, warning-free, on the tiny models.

Regression: the README's transformers snippet passed `past_key_values=`, which
transformers 5.2x deprecates (a FutureWarning on every generate). The blocks are read
from README.md itself, so an edit there is what runs here; the names they leave to the
reader (`k`, `v`, `q`, `ids`, `model`, `inputs`) are given small tensors and models.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"
KV_SHAPE = (1, 2, 40, 64)  # [batch, kv_heads, tokens, head_dim]


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _block(marker: str) -> str:
    found = [b for b in _blocks() if marker in b]
    assert len(found) == 1, f"README: expected one python block with {marker!r}, got {len(found)}"
    return found[0]


def _run_strict(code: str, namespace: dict) -> dict:
    """exec `code` with every warning raised as an error (imports done beforehand)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 (the README's own code)
    return namespace


def test_readme_has_the_three_snippets():
    assert len(_blocks()) == 3


def test_library_snippet():
    torch.manual_seed(0)
    k, v = torch.randn(2, *KV_SHAPE).unbind(0)
    q = torch.randn(1, 4, 3, 64)
    ns = _run_strict(_block("FullCache("), {"k": k, "v": v, "q": q})
    assert ns["out"].shape == (1, 4, 3, 64) and ns["cache"].used_nbytes > 0


def test_runner_snippet():
    import kvtax.models  # noqa: F401  (imported before warnings become errors)

    ids = torch.randint(0, 256, (1, 16))
    ns = _run_strict(_block("Runner("), {"ids": ids})
    assert len(ns["result"].tokens) >= 1


def test_transformers_snippet():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import kvtax.hf  # noqa: F401  (imported before warnings become errors)
    from kvtax.hf.models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, 97, (1, 12))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    ns = _run_strict(_block("KVTaxCache("), {"model": model, "inputs": inputs})
    assert ns["out"].shape[1] > ids.shape[1]
    assert ns["cache"].specs[0].name == "int8+hk+ck"
