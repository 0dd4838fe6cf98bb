"""Text for in-process engines: one tokenizer view and one greedy generation loop.

`TextEngine` gives an engine `tokenize` / `detokenize` / `prefix_ids` / `render_chat`
through the harness's one tokenizer protocol (kvtax.harness.text.TextTokenizer: HF
tokenizers without automatic special tokens, plus their BOS and chat template; or the
byte tokenizer of the built-in random configs), and `generate` as prefill + greedy
`decode(1)` steps that stop at EOS or when `stop(text)` says so. Subclasses set `self.text`
(None: no tokenizer) and `self.eos` in `load` and keep the last sampled token in
`last_token()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtax.harness.engines.base import EngineUnavailable


def eos_ids(*sources: Any) -> set[int]:
    """Every EOS id named by `sources` (ints, lists of ints or None)."""
    out: set[int] = set()
    for s in sources:
        for x in s if isinstance(s, list | tuple | set) else [s]:
            if x is not None:
                out.add(int(x))
    return out


class TextEngine:
    """Mixin: tokenizer delegation and greedy `generate` (see the module docstring)."""

    text: Any = None
    eos: set[int] = set()
    name: str
    spec: Any

    def _text(self) -> Any:
        if self.text is None:
            raise EngineUnavailable(f"engine {self.name}: {self.spec.model} has no tokenizer")
        return self.text

    def tokenize(self, text: str) -> list[int]:
        return list(self._text().encode(text))

    def detokenize(self, ids: list[int]) -> str:
        return str(self._text().decode(list(ids)))

    def prefix_ids(self) -> list[int]:
        """Tokens the tokenizer puts before any text (BOS)."""
        return list(getattr(self._text(), "prefix_ids", lambda: [])())

    def render_chat(self, user_text: str) -> str | None:
        """The chat template around one user message (None: the model has none)."""
        render = getattr(self._text(), "render_chat", None)
        return render(user_text) if render else None

    def last_token(self) -> int:
        raise NotImplementedError

    def generate(self, ids: list[int], max_new_tokens: int,
                 stop: Callable[[str], bool] | None = None) -> list[int]:
        """Greedy tokens after `ids` from a fresh cache, EOS excluded (it ends the answer)."""
        out: list[int] = []
        if max_new_tokens <= 0:
            return out
        self.prefill(ids)  # type: ignore[attr-defined]
        while True:
            tok = self.last_token()
            if tok in self.eos:
                break
            out.append(tok)
            if len(out) >= max_new_tokens or (stop is not None and stop(self.detokenize(out))):
                break
            self.decode(1)  # type: ignore[attr-defined]
        self.reset()  # type: ignore[attr-defined]
        return out
