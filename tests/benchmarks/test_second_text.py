"""The held-out quality text: the committed file is what the script writes (CPython 3.11)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import second_text  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "held_out_text.txt"


def test_strip_html_keeps_visible_text_only():
    page = "<html><head><title>x</title><style>p{}</style></head><body><p>a &amp; b</p>\n\n\n<p>c</p></body>"
    assert second_text.strip_html(page) == "a & b\n\nc"


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the text of record is CPython 3.11's")
def test_committed_text_is_the_scripts_output():
    assert DATA.read_text(encoding="utf-8") == second_text.second_text()


def test_usage_error_exits_2(capsys):
    assert second_text.main([]) == 2
    assert "usage" in capsys.readouterr().err
