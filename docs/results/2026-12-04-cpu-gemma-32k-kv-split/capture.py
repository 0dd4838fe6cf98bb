"""The scripts' input: `forward()` of ../2026-12-04-cpu-key-code-fit/keys.py, one float32
forward over the first TOKENS tokens of the usual text (model, keys and values per layer)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "2026-12-04-cpu-key-code-fit"))
from keys import forward  # noqa: E402,F401
