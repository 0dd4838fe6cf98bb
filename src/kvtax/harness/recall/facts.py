"""Planted facts for the recall probe, and the grader that checks an answer against one.

A fact is one sentence holding a value the model cannot guess: a number written with a
thousands separator ("Marta paid exactly 4,182 copper coins for the map.") or a code
("The vault code for the east wing is QX-4471."). Each fact has its own subject, so each
question has exactly one right answer.

Grading is by the VALUE, never by the words around it (a published planted-fact recall
test's grader marked "4,182 copper coins" wrong because it searched for the filler word
"exactly"):
  - numbers: digit separators are normalised (4,182 == 4182 == 4 182 == 4_182); a number
    inside a longer one does not count (14182 is not 4182), nor does a decimal (4182.5);
  - codes: case and separator are normalised (qx 4471 == QX-4471 == QX4471); a code inside
    a longer alphanumeric run does not count (QX-44710, AQX-4471);
  - the FIRST value of the planted value's kind in the answer is the one graded, so a wrong
    number followed by the right one ("4183, no, 4182") is wrong, as a hedge should be.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

# A number: plain digits, or digits grouped in threes by , space, thin/no-break space, _ or '.
# An optional decimal part is captured so that 4182.5 is read as 4182.5, not 4182.
_SEP = r"[,\u00a0\u202f\u2009 _']"
_NUMBER_RE = re.compile(rf"(?<![\w.,])(\d{{1,3}}(?:{_SEP}\d{{3}})+|\d+)(\.\d+)?(?![\w])")
_CODE_VALUE_RE = re.compile(r"^([A-Za-z]+)[-\s_]?(\d+)$")
_NUMBER_VALUE_RE = re.compile(rf"^(\d{{1,3}}(?:{_SEP}\d{{3}})+|\d+)$")


def value_kind(value: str) -> str:
    """'number' for values like '4,182' or '4182', 'code' for values like 'QX-4471'."""
    text = value.strip()
    if _NUMBER_VALUE_RE.match(text):
        return "number"
    if _CODE_VALUE_RE.match(text):
        return "code"
    raise ValueError(f"planted value {value!r} is neither a number nor a LETTERS-DIGITS code")


def normalise(value: str) -> str:
    """Canonical form of a planted value: digits only for numbers, upper alnum for codes."""
    if value_kind(value) == "number":
        return re.sub(r"\D", "", value)
    letters, digits = _CODE_VALUE_RE.match(value.strip()).groups()  # type: ignore[union-attr]
    return letters.upper() + digits


def candidates(answer: str, kind: str, like: str | None = None) -> list[str]:
    """Values of `kind` found in `answer`, normalised, in order of appearance.

    For codes, `like` (a planted code) fixes the shape searched for: the same number of
    letters and digits, as a whole alphanumeric run.
    """
    if kind == "number":
        out = []
        for m in _NUMBER_RE.finditer(answer):
            whole, frac = m.group(1), m.group(2)
            digits = re.sub(r"\D", "", whole)
            out.append(digits + (frac or ""))
        return out
    if kind != "code":
        raise ValueError(f"unknown value kind {kind!r}")
    if like is None:
        n_letters, n_digits = "+", "+"
    else:
        letters, digits = _CODE_VALUE_RE.match(like.strip()).groups()  # type: ignore[union-attr]
        n_letters, n_digits = f"{{{len(letters)}}}", f"{{{len(digits)}}}"
    code_re = re.compile(
        rf"(?<![A-Za-z0-9])([A-Za-z]{n_letters})[-\s_\u2010-\u2013]?(\d{n_digits})(?![A-Za-z0-9])"
    )
    return [m.group(1).upper() + m.group(2) for m in code_re.finditer(answer)]


def grade(answer: str | None, expected: str) -> bool:
    """True when the first value of `expected`'s kind in `answer` equals `expected`.

    >>> grade("Marta paid 4,182 copper coins.", "4,182"), grade("14182", "4,182")
    (True, False)
    """
    if not answer or not answer.strip():
        return False
    kind = value_kind(expected)
    found = candidates(answer, kind, like=expected if kind == "code" else None)
    return bool(found) and found[0] == normalise(expected)


@dataclass(frozen=True)
class Fact:
    """One planted fact: the sentence in the transcript, the question, and the value."""

    statement: str
    question: str
    value: str

    @property
    def kind(self) -> str:
        return value_kind(self.value)


# (statement, question, kind of value); {s} is the fact's subject, {v} its value.
_TEMPLATES = [
    ("The vault code for the {s} is {v}.", "What is the vault code for the {s}?", "code"),
    ("{s} paid exactly {v} copper coins for the map.",
     "How many copper coins did {s} pay for the map?", "number"),
    ("The locker assigned to {s} opens with the combination {v}.",
     "What combination opens the locker assigned to {s}?", "code"),
    ("The ship {s} carried exactly {v} barrels of salt on its last voyage.",
     "How many barrels of salt did the ship {s} carry on its last voyage?", "number"),
    ("The archive box labelled {s} is filed under reference {v}.",
     "Under which reference is the archive box labelled {s} filed?", "code"),
    ("The orchard of {s} yielded exactly {v} apples this autumn.",
     "How many apples did the orchard of {s} yield this autumn?", "number"),
]
_SUBJECTS = {
    0: ["east wing", "north tower", "river gate", "old library", "glass annex", "cellar stair"],
    1: ["Marta", "Ingrid", "Tomasz", "Odile", "Bartholomew", "Lucinda"],
    2: ["Petra Vance", "Hugo Lindqvist", "Amara Osei", "Felix Morrow", "Rosa Quill"],
    3: ["Albatross", "Grey Heron", "Saltmarsh", "Morning Star", "Kestrel"],
    4: ["Harbour Ledgers", "Winter Accounts", "Bell Foundry", "Tidewater Deeds"],
    5: ["Elsbeth Crane", "Mathias Dorn", "Yara Pell", "Jonas Ferrow", "Clement Ashby"],
}
# Letters that cannot be misread as digits or each other in a code (no I, O, S, Z, B).
_CODE_LETTERS = "ACDEFGHJKLMNPQRTUVWXY"


def make_facts(n: int = 8, seed: int = 0) -> list[Fact]:
    """`n` facts with distinct subjects and values; numbers and codes alternate.

    Every value's digits differ from every other value's digits, so no answer can be right
    for two questions at once.
    """
    if n < 1:
        raise ValueError("need at least one fact")
    capacity = sum(len(v) for v in _SUBJECTS.values())
    if n > capacity:
        raise ValueError(f"at most {capacity} distinct facts are available, asked for {n}")
    rng = random.Random(seed)
    pools = {i: rng.sample(s, len(s)) for i, s in _SUBJECTS.items()}
    used_digits: set[str] = set()
    facts: list[Fact] = []
    t = 0
    while len(facts) < n:
        idx = t % len(_TEMPLATES)
        t += 1
        if not pools[idx]:
            continue
        statement, question, kind = _TEMPLATES[idx]
        subject = pools[idx].pop()
        while True:
            digits = str(rng.randrange(1000, 10000))
            # Distinct, not a repeated digit, not year-like (a model may "know" years).
            year_like = 1900 <= int(digits) < 2100
            if digits not in used_digits and len(set(digits)) > 1 and not year_like:
                break
        used_digits.add(digits)
        if kind == "number":
            value = f"{int(digits):,}"
        else:
            value = "".join(rng.choice(_CODE_LETTERS) for _ in range(2)) + "-" + digits
        facts.append(Fact(statement.format(s=subject, v=value), question.format(s=subject), value))
    return facts
