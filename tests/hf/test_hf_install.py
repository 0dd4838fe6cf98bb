"""Installing the kvtax attention is explicit and reversible; untested families warn."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from kvtax.hf import ATTN_NAME, KVTaxCache, install, installed, is_installed, uninstall
from kvtax.hf.cache import cache_kwarg
from kvtax.hf.models import tiny_config


def _snapshot():
    return dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping)


def _model(family: str = "llama", seed: int = 0, config=None):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config or tiny_config(family)).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_install_uninstall_leaves_transformers_as_it_was() -> None:
    model = _model()
    ids = torch.randint(1, 97, (1, 11))
    before, impl, logits = _snapshot(), model.config._attn_implementation, _logits(model, ids)
    assert ATTN_NAME not in before[0] and ATTN_NAME not in before[1]
    install(model)
    assert is_installed(model) and model.config._attn_implementation == ATTN_NAME
    assert AttentionInterface._global_mapping[ATTN_NAME] is not None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model(ids, **{cache_kwarg(model): KVTaxCache(model.config, kv="int8")})
    uninstall(model)
    assert _snapshot() == before
    assert model.config._attn_implementation == impl and not is_installed(model)
    assert torch.equal(_logits(model, ids), logits)


def test_context_manager_restores_after_an_error() -> None:
    model = _model()
    before, impl = _snapshot(), model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"), installed(model):
        raise RuntimeError("boom")
    assert _snapshot() == before and model.config._attn_implementation == impl


def test_registration_is_counted_across_models() -> None:
    """Uninstalling one model keeps the functions registered for another still installed."""
    a, b = _model("llama"), _model("qwen3")
    before = _snapshot()
    with installed(a):
        with installed(b):
            pass
        assert ATTN_NAME in AttentionInterface._global_mapping
        assert a.config._attn_implementation == ATTN_NAME
    assert _snapshot() == before
    with pytest.raises(RuntimeError, match="not installed"):
        uninstall(a)


def test_double_install_is_refused() -> None:
    model = _model()
    with installed(model), pytest.raises(RuntimeError, match="already installed"):
        install(model)


def test_untested_family_warns_and_tested_does_not() -> None:
    from transformers import OlmoConfig

    olmo = _model(config=OlmoConfig(**{**tiny_config("llama").to_dict(), "model_type": "olmo"}))
    with pytest.warns(UserWarning, match="not been tested with model family 'olmo'"):
        with installed(olmo):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with installed(_model("gemma3")):
            pass


def test_bidirectional_config_is_refused() -> None:
    cfg = tiny_config("gemma3")
    cfg = Gemma3TextConfig(**{**cfg.to_dict(), "use_bidirectional_attention": True})
    model = _model(config=cfg)
    before = _snapshot()
    with pytest.raises(NotImplementedError, match="bidirectional"):
        install(model)
    assert _snapshot() == before and not is_installed(model)
