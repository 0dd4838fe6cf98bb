"""Refuse a tokenizer that splits English far finer than a subword tokenizer does.

transformers 5.17.0 converts Gemma-3-270M's GGUF tokenizer (`gemma-3-270m-q4_k_m.gguf`, a
BPE of 514,906 merges) into a Unigram model: read from the GGUF it spends 0.45 tokens per
character on PROBE, and once saved and reloaded (how kvtax caches a converted GGUF) 1.00,
one per character, with no BOS. transformers 5.24.0 converts the same file to its BPE
(0.20, as Qwen2.5's and SmolLM2's tokenizers). A model fed such tokens still runs and gives
numbers (fp16 perplexity of benchmarks/data/held_out_text.txt at 2k: 3,279 with 5.17.0's
conversion, 31.0 with 5.24.0's; 2026-12-02), so every quality and recall figure from such a
run is silently wrong: the check stops it at load.
"""

from __future__ import annotations

from typing import Any

from kvtax.errors import TokenizerError

# Common English words: the subword tokenizers of the models kvtax runs spend 0.20 tokens
# per character on it (one per word and space); above 0.35 the vocabulary is not in use.
LIMIT = 0.35
PROBE = "The quick brown fox jumps over the lazy dog while the results are measured."


def tokens_per_char(tok: Any) -> float:
    """Tokens per character `tok` (a transformers tokenizer) spends on PROBE."""
    try:
        ids = tok.encode(PROBE, add_special_tokens=False)
    except TypeError:  # a tokenizer whose encode takes no such keyword
        ids = tok.encode(PROBE)
    return len(ids) / len(PROBE)


def check_tokenizer(tok: Any, source: object) -> None:
    """Raise TokenizerError when `tok` spends more than LIMIT tokens per character on PROBE."""
    rate = tokens_per_char(tok)
    if rate > LIMIT:
        import transformers

        raise TokenizerError(
            f"{source}: its tokenizer spends {rate:.2f} tokens per character of plain English "
            f"(a subword tokenizer: about 0.2; transformers {transformers.__version__}), so "
            "the model would read text split unlike its training data. Use a "
            "transformers release that converts this tokenizer (5.24.0 converts Gemma-3's "
            "GGUF correctly, 5.17.0 does not); a kvtax GGUF folder converted before is under "
            "~/.cache/kvtax/gguf/ (or $KVTAX_CACHE/gguf/): delete it to convert again"
        )
