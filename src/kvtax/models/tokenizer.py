"""Text ↔ ids: the checkpoint's Hugging Face tokenizer, or bytes for built-in random configs.

    >>> tok = load_tokenizer(model)          # HF tokenizer when model.source has one
    >>> ids = tok.encode("hello")            # list[int]
    >>> tok.decode(ids)
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from kvtax.models.decoder import DecoderModel
from kvtax.models.tokenizer_check import check_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS (256) and EOS (257); for random-weight models.

    Decoding drops ids outside the byte range and replaces broken UTF-8 sequences.
    """

    bos_token_id = 256
    eos_token_id = 257

    def __init__(self, add_bos: bool = True) -> None:
        self.add_bos = add_bos

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Thin wrapper over `transformers.AutoTokenizer` with the same encode/decode."""

    def __init__(self, folder: str | Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(folder))
        check_tokenizer(self.tok, folder)  # also catches a folder converted by a bad release
        self.eos_token_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model: DecoderModel) -> Tokenizer:
    """The tokenizer in the model's source folder, else bytes (needs vocab >= 258)."""
    src = model.source
    if src is not None and any((Path(src) / f).exists() for f in _TOKENIZER_FILES):
        return HFTokenizer(src)
    if model.config.vocab_size < 258:
        raise ValueError(
            f"no tokenizer next to the weights and vocab {model.config.vocab_size} is too small "
            "for the byte tokenizer (needs 258)"
        )
    return ByteTokenizer()
