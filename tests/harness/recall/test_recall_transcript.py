"""The transcript builder: exact token counts and facts at the requested depths."""

from __future__ import annotations

import pytest

from kvtax.harness.recall.facts import make_facts
from kvtax.harness.recall.transcript import (
    FillerStream,
    build_prompt,
    build_prompts,
    default_filler_paragraphs,
    filler_paragraphs,
    min_context,
    pydoc_topics,
    spread_depths,
)


class ByteTokenizer:
    """One token per UTF-8 byte, BOS = 256: every text has a known token count."""

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def prefix_ids(self):
        return [256]


class WordTokenizer:
    """Whitespace-separated words (with their leading space) as tokens, plus a chat template."""

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.inv: list[str] = []

    def encode(self, text):
        import re

        out = []
        for piece in re.findall(r"\s*\S+|\s+", text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.inv)
                self.inv.append(piece)
            out.append(self.vocab[piece])
        return out

    def decode(self, ids):
        return "".join(self.inv[i] for i in ids)

    def render_chat(self, user_text):
        return f"<user> {user_text} </user> <assistant>"


@pytest.fixture(scope="module")
def paragraphs():
    return default_filler_paragraphs()


@pytest.mark.parametrize("snap", [0, 48], ids=["exact", "snapped"])
@pytest.mark.parametrize("context", [700, 1777, 4096, 9000], ids=lambda c: f"ctx{c}")
@pytest.mark.parametrize("tok_cls", [ByteTokenizer, WordTokenizer], ids=["bytes", "words"])
def test_exact_length_and_depths(tok_cls, context, snap, paragraphs):
    tok = tok_cls()
    n = 3 if context < 4000 else 8  # bytes are long tokens: keep facts sparse in the document
    facts = make_facts(n, seed=context)
    depths = spread_depths(n)
    filler = FillerStream(tok, paragraphs)
    prompts = build_prompts(tok, filler, facts, depths, context, snap=snap)
    shared = prompts[0].shared
    assert len({tuple(p.ids[:shared]) for p in prompts}) == 1, "head + document are shared"
    for q, p in enumerate(prompts):
        assert len(p.ids) == context
        text = tok.decode(p.ids)
        assert facts[q].question in text
        start, end = p.document
        doc_len = shared - start  # the shared document; end - shared is this question's pad
        for i, f in enumerate(facts):
            fact_ids = tok.encode("\n" + f.statement + "\n")
            s = p.fact_starts[i]
            assert p.ids[s:s + len(fact_ids)] == fact_ids, f"fact {i} not where reported"
            assert start <= s and s + len(fact_ids) <= shared
            # Placed at the requested depth of the shared document: to the token, or moved
            # at most `snap` tokens to follow the end of a filler sentence.
            exact = round(depths[i] * (doc_len - len(fact_ids)))
            assert abs((s - start) - exact) <= snap
            # Words: a sentence always ends within 48 tokens (bytes: not always).
            if snap and tok_cls is WordTokenizer and 0 < s - start and i < len(facts) - 1:
                assert tok.decode(p.ids[s - 1:s]).rstrip(" ")[-1:] in ".\n!?:", "mid-sentence"
            # The reported depth is measured in the document this question sees.
            assert p.depths[i] == (s - start) / (end - start - len(fact_ids))
            assert abs(p.depths[i] - depths[i]) <= (end - shared + 1 + snap) / (
                doc_len - len(fact_ids))
        assert p.fact_starts[0] == start, "depth 0 is the document's first token"
        last = tok.encode("\n" + facts[-1].statement + "\n")
        assert p.fact_starts[-1] + len(last) == shared, "depth 1 ends the shared document"
    assert min(p.document[1] for p in prompts) == shared, "the longest question has no pad"
    assert build_prompt(tok, filler, facts, depths, context, 1, snap=snap).ids == prompts[1].ids


def test_chat_template_frames_the_document(paragraphs):
    tok = WordTokenizer()
    facts = make_facts(3)
    p = build_prompt(tok, FillerStream(tok, paragraphs), facts, [0.2, 0.5, 0.9], 900, 1)
    text = tok.decode(p.ids)
    assert text.startswith("<user>") and text.endswith("<assistant>")
    assert text.index(facts[1].question) > text.index(facts[2].statement)


def test_crowded_depths_do_not_overlap(paragraphs):
    """Facts asked at one depth are placed one after another, never on top of each other."""
    tok = ByteTokenizer()
    facts = make_facts(4)
    p = build_prompt(tok, FillerStream(tok, paragraphs), facts, [0.5] * 4, 1500, 0)
    spans = sorted(
        (s, s + len(tok.encode("\n" + f.statement + "\n"))) for s, f in zip(p.fact_starts, facts)
    )
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert len(p.ids) == 1500


def test_too_short_context_says_how_long(paragraphs):
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="at least"):
        build_prompt(tok, FillerStream(tok, paragraphs), make_facts(8), spread_depths(8), 300, 0)


@pytest.mark.parametrize("n_facts", [1, 4])
def test_min_context_is_exactly_the_shortest_that_builds(paragraphs, n_facts):
    """`kvtax recall --contexts 512 --facts 4` (its help's example) raised on every question;
    the CLI now refuses it up front with this minimum, which must match build_prompts."""
    tok = ByteTokenizer()
    facts, depths = make_facts(n_facts), spread_depths(n_facts)
    need = min_context(tok, facts)
    prompts = build_prompts(tok, FillerStream(tok, paragraphs), facts, depths, need)
    assert all(len(p.ids) == need for p in prompts)
    with pytest.raises(ValueError, match=f"at least {need}"):
        build_prompts(tok, FillerStream(tok, paragraphs), facts, depths, need - 1)


def test_filler_is_prose_and_files_work(tmp_path, paragraphs):
    assert len(paragraphs) > 100
    assert not any("::=" in p or ">>>" in p for p in paragraphs)
    f = tmp_path / "filler.txt"
    f.write_text("First paragraph here.\n\nSecond   one\nwraps.\n\n\n")
    assert filler_paragraphs(f) == ["First paragraph here.", "Second one wraps."]
    # Contexts longer than the filler cycle through it.
    tok = ByteTokenizer()
    stream = FillerStream(tok, filler_paragraphs(f))
    assert len(stream.take(5000)) == 5000
    assert stream.take(10) == tok.encode("First para")


def test_a_pydoc_topics_file_gives_that_pythons_prose(tmp_path):
    # This Python's own topics.py, read as a file, gives exactly the default prose and text:
    # a run elsewhere reads another release's prose from that release's file.
    import pydoc_data.topics

    from kvtax.harness.quality.probe import text_of

    own = pydoc_data.topics.__file__
    assert pydoc_topics(own) == pydoc_data.topics.topics
    assert filler_paragraphs(own) == default_filler_paragraphs()
    assert text_of(own) == text_of(None)
    # Another release's dict: its own prose, filtered the same way; the file is parsed, not run.
    long = "A sentence of plain prose that runs well past the eighty characters a paragraph needs."
    f = tmp_path / "topics.py"
    f.write_text("# Autogenerated by Sphinx\nimport sys; sys.exit(3)\n"
                 f"topics = {{'b': {long!r} + '\\n\\n>>> code\\n', 'a': 'short'}}\n")
    assert pydoc_topics(f) is None  # not a literal: never evaluated
    f.write_text(f"topics = {{'b': {long!r} '\\n\\n>>> code\\n', 'a': 'short'}}\n")
    assert filler_paragraphs(f) == [long] and text_of(str(f)) == long
    # Any other .py file, or text, stays a text file.
    g = tmp_path / "notes.py"
    g.write_text("x = 1\n\nSecond paragraph.\n")
    assert pydoc_topics(g) is None and filler_paragraphs(g) == ["x = 1", "Second paragraph."]
