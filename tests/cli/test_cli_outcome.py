"""The exit status a command derives from its rows, and the checks run before any work."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtax.cli.outcome import ALL_FAILED, OK, SOME_FAILED, tally
from kvtax.cli.validate import at_least, check_contexts, parse_contexts
from kvtax.errors import ModelNotFoundError, OptionError
from kvtax.models import get_config, locate, model_config
from kvtax.models.loading import CheckpointError


def _rows(*statuses: str) -> list[dict]:
    err = "Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named 'triton'"
    return [{"status": s, "phase": "setup", "error": None if s == "ok" else err}
            for s in statuses]


def test_all_failed_names_the_count_and_the_most_common_error():
    t = tally(_rows(*["error"] * 130))
    assert t.exit_code == ALL_FAILED
    assert t.line("kvtax bench", "cells") == (
        "kvtax bench: 0 of 130 cells measured; 130 failed: error in setup: "
        "ModuleNotFoundError: No module named 'triton'")


@pytest.mark.parametrize("statuses, code", [
    (("ok", "ok"), OK),
    (("ok", "unavailable", "skipped"), OK),       # an arm this machine cannot run is no failure
    (("ok", "oom"), SOME_FAILED),
    (("ok", "timeout", "error"), SOME_FAILED),
    (("oom", "timeout"), ALL_FAILED),
    (("unavailable", "skipped"), ALL_FAILED),     # nothing measured is never success
    ((), ALL_FAILED),
], ids=["ok", "ok+not-run", "partial-oom", "partial-mixed", "all-failed", "none-run", "empty"])
def test_exit_code_per_outcome(statuses, code):
    assert tally(_rows(*statuses)).exit_code == code


def test_partial_line_counts_each_kind():
    rows = _rows("ok", "error", "unavailable") + [
        {"status": "oom", "phase": "decode", "error": "OutOfMemoryError: 2 GiB"}]
    line = tally(rows).line("kvtax recall", "questions")
    assert line.startswith("kvtax recall: 1 of 4 questions measured; 2 failed: ")
    assert "(1 of them)" in line and line.endswith("; 1 skipped or unavailable")


def test_parse_contexts():
    assert parse_contexts("4k, 512,1.5k") == [4096, 512, 1536]
    for bad in ("abc", "0", "-4", "", "1.3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_contexts(bad)


def test_at_least():
    assert at_least(1)("3") == 3
    for bad in ("0", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            at_least(1)(bad)


def test_contexts_past_the_models_positions_need_the_flag():
    cfg = get_config("tiny")  # 8192 positions
    check_contexts([8192], cfg, allow_long=False)
    with pytest.raises(OptionError, match="past tiny's maximum of 8,192.*--allow-long-context"):
        check_contexts([128, 8193], cfg, allow_long=False)
    check_contexts([8193], cfg, allow_long=True)


def test_locate_and_model_config(tmp_path):
    assert locate("tiny") == ("builtin", "tiny")
    assert locate("Qwen/Qwen3-0.6B") == ("hub", "Qwen/Qwen3-0.6B")
    for missing in ("/nonexistent", "x.gguf", "no-such-model"):
        with pytest.raises(ModelNotFoundError, match="not found"):
            locate(missing)
    with pytest.raises(CheckpointError, match="no config.json"):
        model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="cannot be read"):
        model_config(tmp_path)  # a config missing its shape keys: one KVTaxError, no KeyError
    hf = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 1234}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert model_config(tmp_path).max_position_embeddings == 1234


def test_quality_context_at_the_models_maximum_is_in_range():
    # A context of c feeds c input tokens; the (c+1)-th is only a target, so the
    # model's own maximum (8,192 for tiny) is a valid --contexts and one more is not.
    from kvtax.cli import build_parser
    from kvtax.cli.quality import check

    parse = build_parser().parse_args
    assert check(parse(["quality", "--model", "tiny", "--contexts", "8k"])) == [8192]
    with pytest.raises(OptionError, match="context 8,193 is past tiny's maximum of 8,192"):
        check(parse(["quality", "--model", "tiny", "--contexts", "8193"]))
