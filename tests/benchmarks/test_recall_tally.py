"""benchmarks/recall_tally.py: recall pooled over run folders, kept / gained fact by fact."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import recall_tally  # noqa: E402


def _row(kv, seed, ctx, fact, correct, status="ok"):
    return {"kind": "recall", "kv": kv, "order_seed": seed, "context": ctx, "fact_index": fact,
            "correct": correct, "status": status, "expected": f"V{fact}",
            "answer": f"V{fact}" if correct else "other"}


def _run(tmp_path, name, rows):
    d = tmp_path / name / "20260101T000000Z-recall"
    d.mkdir(parents=True)
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / name)


def test_pools_runs_and_counts_kept_and_gained(tmp_path, capsys):
    # seed 0 in one run with the baseline, the format's answers in another run.
    a = _run(tmp_path, "base", [_row("fp16", 0, 512, i, ok) for i, ok in enumerate([1, 1, 0, 1])]
             + [_row("fp16", 1, 512, 0, True)])
    b = _run(tmp_path, "fmt", [_row("q4", 0, 512, i, ok) for i, ok in enumerate([1, 0, 1, 1])]
             + [_row("q4", 1, 512, 0, True, status="error")])  # a failed question: left out
    answers = recall_tally.load_answers([a, b])
    rows = {r["kv"]: r for r in recall_tally.tally(answers, "fp16")}
    q4 = rows["q4"]
    assert (q4["asked"], q4["seeds"], q4["base"], q4["right"]) == (4, 1, 3, 3)
    assert (q4["kept"], q4["gained"], q4["lost"]) == (2, 1, [(0, 512, 1)])
    assert rows["fp16"]["kept"] == rows["fp16"]["base"] == 4
    assert recall_tally.main([a, b, "--swaps"]) == 0
    out = capsys.readouterr().out
    assert "| q4 | 512 | 1 | 4 | 3 | 3 | 2 / 3 | 1 | 1 |" in out  # one lost, one gained: p 1
    assert "q4 lost: seed 0 context 512 fact 1" in out and "q4 gained: seed 0 context 512 fact 2" in out


def test_two_runs_that_disagree_are_refused(tmp_path):
    a = _run(tmp_path, "a", [_row("fp16", 0, 512, 0, True)])
    b = _run(tmp_path, "b", [_row("fp16", 0, 512, 0, False)])
    with pytest.raises(ValueError, match="two runs disagree"):
        recall_tally.load_answers([a, b])


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert recall_tally.main([str(tmp_path / "none")]) == 2
    a = _run(tmp_path, "a", [_row("q4", 0, 512, 0, True)])
    assert recall_tally.main([a]) == 2  # no fp16 rows to compare with
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("recall_tally: ") for line in err)


def test_mcnemar_exact_two_sided():
    # the discordant pairs of q4's 8-seed Qwen recall (11 lost, 8 gained) and an uneven split
    assert recall_tally.mcnemar_p(11, 8) == pytest.approx(0.6476, abs=1e-4)
    assert recall_tally.mcnemar_p(16, 1) == pytest.approx(36 / 2**17)
    assert recall_tally.mcnemar_p(8, 11) == recall_tally.mcnemar_p(11, 8)
    assert recall_tally.mcnemar_p(0, 0) == recall_tally.mcnemar_p(2, 2) == 1.0
    assert recall_tally.mcnemar_p(6, 0) == pytest.approx(2 / 64)


def test_contexts_pool_into_an_all_row(tmp_path, capsys):
    base = [_row("fp16", 0, c, i, True) for c in (512, 1024) for i in range(4)]
    fmt = ([_row("q4", 0, 512, i, ok) for i, ok in enumerate([0, 0, 1, 1])]
           + [_row("q4", 0, 1024, i, ok) for i, ok in enumerate([0, 1, 1, 1])])
    a, b = _run(tmp_path, "base", base), _run(tmp_path, "fmt", fmt)
    rows = recall_tally.tally(recall_tally.load_answers([a, b]), "fp16")
    pooled = [r for r in rows if r["kv"] == "q4" and r["context"] == "all"]
    assert len(pooled) == 1 and (pooled[0]["asked"], pooled[0]["kept"]) == (8, 5)
    assert len(pooled[0]["lost"]) == 3
    assert recall_tally.main([a, b]) == 0
    assert "| q4 | all | 1 | 8 | 8 | 5 | 5 / 8 | 0 | 0.25 |" in capsys.readouterr().out
