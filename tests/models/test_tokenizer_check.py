"""A tokenizer that lost its merges (one token per character) is refused at load."""

from __future__ import annotations

import pytest

from kvtax.errors import TokenizerError
from kvtax.models.tokenizer import HFTokenizer
from kvtax.models.tokenizer_check import PROBE, check_tokenizer, tokens_per_char

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")


def _fast(model: "tokenizers.models.Model", pre: bool) -> "transformers.PreTrainedTokenizerFast":
    tok = tokenizers.Tokenizer(model)
    if pre:
        tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def char_level() -> "transformers.PreTrainedTokenizerFast":
    """What a conversion without merges gives: one id per character."""
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(sorted(set(PROBE)))}}
    return _fast(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"), pre=False)


def word_level() -> "transformers.PreTrainedTokenizerFast":
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(sorted(set(PROBE.split())))}}
    return _fast(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"), pre=True)


def test_character_level_tokenizer_is_refused_with_the_fix_in_the_message():
    tok = char_level()
    assert tokens_per_char(tok) > 0.9
    with pytest.raises(TokenizerError, match=r"tokens per character.*transformers.*delete it"):
        check_tokenizer(tok, "gemma-3-270m-q4_k_m.gguf")


def test_subword_tokenizer_passes():
    tok = word_level()
    assert tokens_per_char(tok) < 0.25
    check_tokenizer(tok, "model")  # no error


def test_loading_a_saved_character_level_tokenizer_is_refused(tmp_path):
    char_level().save_pretrained(str(tmp_path))
    with pytest.raises(TokenizerError):
        HFTokenizer(tmp_path)
    word_level().save_pretrained(str(tmp_path / "ok"))
    assert HFTokenizer(tmp_path / "ok").encode("The quick") != []
