"""Token-exact recall prompts: filler text grown to a context, facts planted at chosen depths.

A prompt is `head + document + pad + tail`, built as token ids so that its length is
exactly the requested context, whatever the tokenizer:
  - head: the chat template up to the user's message (or the tokenizer's BOS) and a one-line
    instruction;
  - document: filler tokens with each fact's tokens spliced in at its depth, where depth 0
    puts a fact first in the document and depth 1 makes it end the document;
  - pad: a few more filler tokens, as many as this question is shorter than the longest;
  - tail: the question and the rest of the chat template (the assistant's turn), or
    "Answer:" for a model without a chat template.
head + document is the same for every question of a context, so it is prefilled once.
Filler is prose from CPython's `pydoc_data/topics.py` (every Python has it; another
release's file gives that release's prose, `pydoc_topics`) or a text file.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvtax.harness.recall.facts import Fact
from kvtax.harness.text import TextTokenizer

INTRO = (
    "Read the document below. Somewhere in it are a few sentences that record codes and "
    "numbers; you will be asked for one of them.\n\n"
)
ASK = "\n\nQuestion: {question}\nReply with the exact value only, on one line."
_SENTINEL = "\u2063KVTAX_DOCUMENT\u2063"
SNAP = 48  # tokens a fact may move from its exact depth to sit between two sentences


def frame_ids(
    tok: TextTokenizer, question: str, use_chat: bool = True
) -> tuple[list[int], list[int]]:
    """(head ids, tail ids) that surround the document for one question."""
    ask = ASK.format(question=question)
    render = getattr(tok, "render_chat", None)
    rendered = render(_SENTINEL) if (use_chat and render) else None
    if rendered is not None and rendered.count(_SENTINEL) == 1:
        before, after = rendered.split(_SENTINEL)
        return tok.encode(before + INTRO), tok.encode(ask + after)
    prefix = list(getattr(tok, "prefix_ids", lambda: [])())
    return prefix + tok.encode(INTRO), tok.encode(ask + "\nAnswer:")


_CODE_LINE = re.compile(r"^(\s|>>>|\.\.\.)")
_HEAVY_DIGITS = re.compile(r"\d{3,}")


def pydoc_topics(path: str | Path) -> dict[str, str] | None:
    """The `topics` dict of a `pydoc_data/topics.py` file, parsed (never run), or None where
    the file is not one. The default text changes between Python releases (3.11's and
    3.12's differ, and 3.12.1's and 3.12.3's), so a run elsewhere reads the same prose as
    Python 3.12.3 from that release's file, e.g. out of its Debian/Ubuntu
    `libpython3.12-stdlib` package."""
    path = Path(path)
    if path.suffix != ".py":
        return None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
                "topics"]:
            try:
                topics = ast.literal_eval(node.value)
            except ValueError:
                return None
            if isinstance(topics, dict) and all(isinstance(v, str) for v in topics.values()):
                return topics
    return None


def default_filler_paragraphs(topics: dict[str, str] | None = None) -> list[str]:
    """Prose paragraphs of `pydoc_data/topics.py` (this Python's, or the `topics` dict of
    another's, `pydoc_topics`): no code, grammar, headings or long numbers."""
    if topics is None:
        from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[key]):
            lines = para.split("\n")
            text = " ".join(line.strip() for line in lines)
            if (
                len(text) < 80
                or any(_CODE_LINE.match(line) for line in lines)
                or re.fullmatch(r"[*=\-~^]+", lines[-1].strip() or "x")
                or "::=" in text
                or _HEAVY_DIGITS.search(text)
                or sum(c.isalpha() or c in " ,.;:'\"()-" for c in text) < 0.9 * len(text)
            ):
                continue
            out.append(text)
    return out


def default_prose(path: str | Path | None = None) -> list[str] | None:
    """The default prose's paragraphs: this Python's (path None) or those of the
    `pydoc_data/topics.py` file at `path`; None where `path` is another file."""
    if path is None:
        return default_filler_paragraphs()
    topics = pydoc_topics(path)
    return None if topics is None else default_filler_paragraphs(topics)


def filler_paragraphs(path: str | Path | None = None) -> list[str]:
    """Paragraphs from a text file (blank-line separated), or the default prose (this
    Python's, or that of a `pydoc_data/topics.py` file given as `path`)."""
    paras = default_prose(path)
    if paras is not None:
        return paras
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    paras = [p for p in paras if p]
    if not paras:
        raise ValueError(f"filler file {path} holds no text")
    return paras


@dataclass
class FillerStream:
    """Filler token ids, encoded lazily and cycled through the paragraphs as needed."""

    tok: TextTokenizer
    paragraphs: list[str]
    _ids: list[int] = field(default_factory=list)
    _next: int = 0

    def take(self, n: int) -> list[int]:
        """The first `n` filler ids (the same prefix every call, so contexts nest)."""
        while len(self._ids) < n:
            # Encode a batch of paragraphs at once; each starts a new paragraph ("\n\n").
            batch = []
            for _ in range(64):
                batch.append(self.paragraphs[self._next % len(self.paragraphs)])
                self._next += 1
            sep = "\n\n" if self._ids else ""
            self._ids.extend(self.tok.encode(sep + "\n\n".join(batch)))
        return self._ids[:n]


@dataclass(frozen=True)
class Prompt:
    """One recall prompt: `ids` has exactly the requested context length.

    `ids[:shared]` (frame head + the document with every fact) is the same for every
    question of one context, so a runner can prefill it once. `fact_starts[i]` is the
    index in `ids` where fact i's tokens begin, `depths[i]` its measured depth in the
    document (0 = its first token, 1 = the fact ends the document), and `document` =
    (start, end) of the document in `ids`: the shared part plus the few filler tokens
    that pad a short question to the exact context.
    """

    ids: list[int]
    fact_starts: list[int]
    depths: list[float]
    document: tuple[int, int]
    question_index: int
    shared: int


def spread_depths(n: int) -> list[float]:
    """n depths spread evenly from 0 to 1 (one fact: the middle)."""
    if n == 1:
        return [0.5]
    return [i / (n - 1) for i in range(n)]


def min_context(tok: TextTokenizer, facts: Sequence[Fact], use_chat: bool = True) -> int:
    """The shortest context `build_prompts` accepts for `facts`: the frame (head + the
    longest question's tail) plus every fact's tokens, with no filler at all."""
    frames = [frame_ids(tok, f.question, use_chat) for f in facts]
    head, max_tail = len(frames[0][0]), max(len(t) for _, t in frames)
    return head + max_tail + sum(len(tok.encode("\n" + f.statement + "\n")) for f in facts)


def build_prompts(
    tok: TextTokenizer,
    filler: FillerStream,
    facts: Sequence[Fact],
    depths: Sequence[float],
    context: int,
    use_chat: bool = True,
    snap: int = SNAP,
) -> list[Prompt]:
    """One prompt per fact (asking for it), each exactly `context` tokens long.

    All share the head and the document; a question shorter than the longest one is
    preceded by as many extra filler tokens as it is shorter, so lengths match exactly.
    A fact goes where its depth puts it, moved by at most `snap` tokens to fall between
    two sentences of the filler (0: exactly at the depth, even mid-word).
    """
    if len(depths) != len(facts):
        raise ValueError(f"{len(facts)} facts but {len(depths)} depths")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must lie in [0, 1], got {list(depths)}")
    frames = [frame_ids(tok, f.question, use_chat) for f in facts]
    head = frames[0][0]
    if any(h != head for h, _ in frames):
        raise ValueError("the chat template's head depends on the question; cannot share it")
    max_tail = max(len(t) for _, t in frames)
    fact_ids = [tok.encode("\n" + f.statement + "\n") for f in facts]
    doc_len = context - len(head) - max_tail
    fact_total = sum(len(f) for f in fact_ids)
    if doc_len < fact_total:
        raise ValueError(
            f"context {context} is too short: the frame takes {len(head) + max_tail} tokens "
            f"and the facts {fact_total}; use a context of at least "
            f"{len(head) + max_tail + fact_total}"
        )
    n_filler = doc_len - fact_total
    stream = filler.take(n_filler + max_tail)
    order = sorted(range(len(facts)), key=lambda i: depths[i])
    # Place each fact as close to its depth as the facts before and after it allow,
    # between two sentences of the filler when one ends within `snap` tokens.
    starts: dict[int, int] = {}
    end_prev = 0
    for rank, i in enumerate(order):
        n = len(fact_ids[i])
        later = sum(len(fact_ids[j]) for j in order[rank + 1:])
        before = sum(len(fact_ids[j]) for j in order[:rank])
        want = round(depths[i] * (doc_len - n))
        want = before + _sentence_break(tok, stream, want - before, n_filler, snap)
        starts[i] = min(max(want, end_prev), doc_len - n - later)
        end_prev = starts[i] + n
    doc: list[int] = []
    used = 0
    for i in order:
        gap = starts[i] - len(doc)
        doc.extend(stream[used:used + gap])
        used += gap
        doc.extend(fact_ids[i])
    doc.extend(stream[used:n_filler])
    assert len(doc) == doc_len, (len(doc), doc_len)
    shared = len(head) + doc_len
    prompts = []
    for q, (_, tail) in enumerate(frames):
        pad = stream[n_filler:n_filler + max_tail - len(tail)]
        ids = head + doc + pad + tail
        region = doc_len + len(pad)
        prompts.append(Prompt(
            ids=ids,
            fact_starts=[len(head) + starts[i] for i in range(len(facts))],
            depths=[starts[i] / max(1, region - len(fact_ids[i])) for i in range(len(facts))],
            document=(len(head), len(head) + region),
            question_index=q,
            shared=shared,
        ))
    return prompts


def build_prompt(
    tok: TextTokenizer,
    filler: FillerStream,
    facts: Sequence[Fact],
    depths: Sequence[float],
    context: int,
    question_index: int,
    use_chat: bool = True,
    snap: int = SNAP,
) -> Prompt:
    """The prompt asking for `facts[question_index]` (see `build_prompts`)."""
    return build_prompts(tok, filler, facts, depths, context, use_chat, snap)[question_index]


def _sentence_break(tok: TextTokenizer, stream: Sequence[int], at: int, end: int,
                    snap: int) -> int:
    """The filler index nearest `at` (within `snap`) where a sentence or paragraph ends."""
    at = min(max(at, 0), end)
    for delta in range(snap + 1):
        for i in (at - delta, at + delta):
            if i <= 0 or i >= end:
                if 0 <= i <= end:
                    return i
                continue
            if tok.decode([stream[i - 1]]).rstrip(" ").endswith((".", "\n", "!", "?", ":")):
                return i
    return at
