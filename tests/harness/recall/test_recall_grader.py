"""The recall grader on tricky answers, and the facts it grades."""

from __future__ import annotations

import pytest

from kvtax.harness.recall.facts import candidates, grade, make_facts, normalise, value_kind

CASES = [
    # (answer, expected, correct, why)
    ("4,182 copper coins", "4,182", True, "a published grader bug: the right number with its unit"),
    ("Marta paid exactly 4,182 copper coins for the map.", "4,182", True, "echoes the fact"),
    ("4182", "4,182", True, "no separator"),
    ("4 182", "4,182", True, "space separator"),
    ("4\u202f182 coins", "4,182", True, "narrow no-break space separator"),
    ("4_182", "4,182", True, "underscore separator"),
    ("The answer is 4,182.", "4182", True, "sentence full stop after the number"),
    ("4183", "4,182", False, "wrong number"),
    ("14182", "4,182", False, "value only inside a longer number"),
    ("41820 coins", "4,182", False, "value is a prefix of a longer number"),
    ("4182.5", "4,182", False, "a decimal is a different number"),
    ("0.4182", "4,182", False, "digits after a decimal point"),
    ("exactly", "4,182", False, "that grader's filler word alone"),
    ("Marta paid exactly some copper coins.", "4,182", False, "filler words, no value"),
    ("4183, or maybe 4182", "4,182", False, "the first number given is graded"),
    ("", "4,182", False, "empty"),
    ("   \n", "4,182", False, "whitespace"),
    (None, "4,182", False, "no answer"),
    ("the code is QX-4471.", "QX-4471", True, "code in a sentence"),
    ("qx-4471", "QX-4471", True, "lower case"),
    ("QX 4471", "QX-4471", True, "space for hyphen"),
    ("QX4471", "QX-4471", True, "no separator"),
    ("QX-4472", "QX-4471", False, "wrong digit"),
    ("QY-4471", "QX-4471", False, "wrong letter"),
    ("QX-44710", "QX-4471", False, "code inside a longer code"),
    ("AQX-4471", "QX-4471", False, "code inside a longer word"),
    ("4471", "QX-4471", False, "digits without the letters"),
    ("Room 12, code QX-4471", "QX-4471", True, "other shapes are not codes of this shape"),
]


@pytest.mark.parametrize(
    "answer,expected,correct", [c[:3] for c in CASES], ids=[c[3] for c in CASES]
)
def test_grade(answer, expected, correct):
    assert grade(answer, expected) is correct


def test_kinds_and_normal_forms():
    assert value_kind("4,182") == "number" and normalise("4,182") == "4182"
    assert value_kind("QX-4471") == "code" and normalise("qx-4471") == "QX4471"
    assert candidates("paid 1,234,567 then 89", "number") == ["1234567", "89"]
    with pytest.raises(ValueError):
        value_kind("four thousand")


def test_facts_are_distinct_and_self_grading():
    facts = make_facts(12, seed=3)
    assert len({f.question for f in facts}) == 12
    assert {f.kind for f in facts} == {"number", "code"}
    digits = [normalise(f.value)[-4:] for f in facts]
    assert len(set(digits)) == len(digits), "two facts share digits"
    for f in facts:
        assert f.value in f.statement
        assert grade(f.statement, f.value), f.statement
        # No answer is right for two questions.
        assert sum(grade(f.value, g.value) for g in facts) == 1
    assert make_facts(5, seed=3) == facts[:5], "fewer facts must be a prefix (stable runs)"
    assert make_facts(8, seed=1) != make_facts(8, seed=2)
