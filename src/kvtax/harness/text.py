"""The one tokenizer protocol of the harness, and its two implementations.

recall's prompt builder, `kvtax quality`'s text and the in-process engines' `tokenize` /
`detokenize` all speak `TextTokenizer`: a transformers tokenizer (`HFTextTokenizer`) or the
byte tokenizer of the built-in random configs (`ByteTextTokenizer`).

    >>> tok = text_tokenizer()                 # bytes, BOS 256, EOS 257
    >>> tok.prefix_ids() + tok.encode("hi")
    [256, 104, 105]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TextTokenizer(Protocol):
    """Text <-> ids without automatic special tokens, plus what a prompt frame needs.

    encode/decode: no BOS/EOS added or kept; `prefix_ids()`: the tokens the tokenizer puts
    before any text (BOS, or []). Optional: `render_chat(user_text) -> str | None` (the chat
    template around one user message) and `eos_token_id`; callers use getattr for those.
    """

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def prefix_ids(self) -> list[int]: ...


class HFTextTokenizer:
    """A transformers tokenizer seen through `TextTokenizer`, plus its chat template."""

    def __init__(self, tok: Any):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        # Special-token strings in rendered chat templates (<|im_start|>) map to their ids.
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.tok.eos_token_id

    def prefix_ids(self) -> list[int]:
        """Tokens the tokenizer puts before any text by default (usually BOS)."""
        with_special = self.tok("a", add_special_tokens=True)["input_ids"]
        plain = self.tok("a", add_special_tokens=False)["input_ids"]
        n = len(with_special) - len(plain)
        return list(with_special[:n]) if n > 0 and with_special[n:] == plain else []

    def render_chat(self, user_text: str) -> str | None:
        """The chat template applied to one user message, or None without a template."""
        if not getattr(self.tok, "chat_template", None):
            return None
        return self.tok.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
        )


class ByteTextTokenizer:
    """The runner's byte tokenizer without its automatic BOS, which the frame adds once."""

    def __init__(self, bos: int = 256, eos: int = 257):
        self.bos, self.eos_token_id = bos, eos

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))  # [len(bytes)] ids in 0..255

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def prefix_ids(self) -> list[int]:
        return [self.bos]


def text_tokenizer(hf_tokenizer: Any = None, bos: int | None = None,
                   eos: int | None = None) -> TextTokenizer:
    """`HFTextTokenizer` over a transformers tokenizer, else the byte tokenizer (BOS `bos`,
    default 256; EOS `eos`, default 257)."""
    if hf_tokenizer is not None:
        return HFTextTokenizer(hf_tokenizer)
    return ByteTextTokenizer(256 if bos is None else bos, 257 if eos is None else eos)
