"""Every command tells the truth: one line on stderr and the documented exit status.

Each first-contact failure once seen on a fresh machine runs as a real `python -m kvtax.cli` process: its
exit status, exactly one stderr line naming the problem, and no traceback. Most cases
fail before any work starts, so they are launched together (two at a time) once per
module; two small sweeps check the all-failed and partly-failed statuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import kvtax
from kvtax.cli import main, version
from kvtax.cli.outcome import ALL_FAILED, BAD_INPUT, OK, SOME_FAILED, UNEXPECTED

SRC = str(Path(kvtax.__file__).resolve().parents[1])
FAST = ["--reps", "1", "--warmup", "0", "--decode-tokens", "2"]


def kvtax_cli(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m kvtax.cli ARGV` against this source tree."""
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1", KVTAX_FORCE_OOM="")
    return subprocess.run([sys.executable, "-m", "kvtax.cli", *argv], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def _folders(root: Path) -> dict[str, Path]:
    """Run folders that must be refused by --resume, and an --out that cannot be made."""
    made = {}
    for name, config in (("empty-config", {}),
                         ("quality-run", {"kind": "quality", "model": "tiny", "contexts": [64],
                                          "kvs": ["int8"], "baseline": "fp16", "tail": 8})):
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        (d / "rows.jsonl").write_text("")
        made[name] = d
    (root / "empty").mkdir()
    (root / "a-file").write_text("not a folder")
    made.update(empty=root / "empty", missing=root / "missing",
                unwritable=root / "a-file" / "runs")  # a folder under a file: ENOTDIR
    return made


def _cases(f: dict[str, Path]) -> dict[str, tuple[list[str], int, str]]:
    """id → (argv, exit status, text the one stderr line must hold)."""
    out, q = str(f["unwritable"]), str(f["quality-run"])
    tiny_bench = ["bench", "--kv", "fp16", "--paths", "fused", "--contexts", "64", *FAST]
    return {
        "bench-out-unwritable": ([*tiny_bench, "--out", out], BAD_INPUT, "Not a directory"),
        "recall-out-unwritable": (["recall", "--contexts", "600", "--facts", "1", "--kv", "fp16",
                                   "--out", out], BAD_INPUT, "Not a directory"),
        "roofline-out-unwritable": (["roofline", "--model", "tiny", "--contexts", "64",
                                     "--out", out], BAD_INPUT, "Not a directory"),
        "bench-resume-empty": (["bench", "--resume", str(f["empty"])], BAD_INPUT,
                               "not a run folder"),
        "bench-resume-missing": (["bench", "--resume", str(f["missing"])], BAD_INPUT,
                                 "does not exist"),
        "recall-resume-empty": (["recall", "--resume", str(f["empty"])], BAD_INPUT,
                                "not a run folder"),
        "recall-resume-missing": (["recall", "--resume", str(f["missing"])], BAD_INPUT,
                                  "does not exist"),
        "bench-resume-quality-run": (["bench", "--resume", q], BAD_INPUT,
                                     "is a kvtax quality run, not a bench run"),
        "recall-resume-quality-run": (["recall", "--resume", q], BAD_INPUT,
                                      "is a kvtax quality run, not a recall run"),
        "bench-resume-empty-config": (["bench", "--resume", str(f["empty-config"])], BAD_INPUT,
                                      "is empty"),
        "quality-resume-empty-config": (["quality", "--resume", str(f["empty-config"])],
                                        BAD_INPUT, "is empty"),
        "generate-nonexistent": (["generate", "/nonexistent"], BAD_INPUT, "not found"),
        "generate-missing-gguf": (["generate", "--model", "x.gguf"], BAD_INPUT, "not found"),
        "generate-bad-kv": (["generate", "--model", "tiny", "--kv", "int9"], BAD_INPUT,
                            "--kv int9: unknown KV format"),
        "generate-kv-layer-outside": (["generate", "--model", "tiny", "--kv", "q4:L99=int8",
                                       "--max-tokens", "2"], BAD_INPUT,
                                      "layers [99], outside this model's layers 0..3"),
        "recall-model-nonexistent": (["recall", "--model", "/nonexistent"], BAD_INPUT,
                                     "not found"),
        "capacity-reserve-lots": (["capacity", "--reserve", "lots"], BAD_INPUT,
                                  "cannot read a size from 'lots'"),
        "capacity-reserve-no-unit": (["capacity", "--reserve", "13.37"], BAD_INPUT,
                                     "give a unit"),
        "capacity-bad-kv": (["capacity", "--reserve", "1GiB", "--kv", "fp16,int9"], BAD_INPUT,
                            "--kv int9"),
        "demo-bad-format": (["demo", "--formats", "fp16,int9"], BAD_INPUT, "--formats int9"),
        "bench-values-per-channel": (["bench", "--level", "attention", "--kv", "int4w-c64"],
                                     BAD_INPUT, "int4w-c64 is a key format"),
        "roofline-contexts-abc": (["roofline", "--contexts", "abc"], BAD_INPUT,
                                  "not 'abc'"),
        "bench-reps-0": (["bench", "--reps", "0"], BAD_INPUT, "--reps: must be >= 1, got 0"),
        "bench-reps-negative": (["bench", "--reps", "-1"], BAD_INPUT, "must be >= 1, got -1"),
        "bench-model-nonexistent": (["bench", "--model", "/nonexistent"], BAD_INPUT,
                                    "not found"),
        # another engine's missing model file is refused before any cell, too
        "bench-engine-model-nonexistent": (["bench", "--engine", "transformers", "--model",
                                            "missing.gguf"], BAD_INPUT, "not found"),
        "bench-contexts-past-max": (["bench", "--contexts", "100000k"], BAD_INPUT,
                                    "past tiny's maximum of 8,192 positions"),
        "recall-contexts-too-short": (["recall", "--model", "tiny", "--contexts", "512",
                                       "--facts", "4", "--out", out], BAD_INPUT,
                                      "use --contexts of at least 520"),
        "report-not-a-run": (["report", str(f["empty"])], BAD_INPUT, "not a run folder"),
    }


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every fail-fast case run once, two processes at a time: id → CompletedProcess."""
    root = tmp_path_factory.mktemp("cli-errors")
    cases = _cases(_folders(root))
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = {k: pool.submit(kvtax_cli, *argv, cwd=root) for k, (argv, _, _) in cases.items()}
    return {k: (cases[k], fut.result()) for k, fut in done.items()}, root


def _one_line(proc: subprocess.CompletedProcess) -> str:
    """The single non-progress stderr line (progress lines never say 'error')."""
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [x for x in lines if "error" in x]
    assert len(errors) == 1, proc.stderr
    return errors[0]


FOLDERS = ("empty-config", "quality-run", "empty", "missing", "unwritable")
CASE_IDS = sorted(_cases({k: Path(k) for k in FOLDERS}))


@pytest.mark.parametrize("case", CASE_IDS)
def test_refused_with_one_line(refused, case):
    results, _ = refused
    (argv, code, needle), proc = results[case]
    line = _one_line(proc)
    assert proc.returncode == code, (argv, proc.returncode, proc.stderr)
    assert line.startswith(f"kvtax {argv[0]}: error: ") and needle in line, line


def test_refused_runs_leave_no_run_folder(refused):
    """The cases ran in one folder with the default --out runs: none got as far as making a
    run folder (recall-contexts-too-short, given an unwritable --out, names the context)."""
    _, root = refused
    assert not (root / "runs").exists()


def test_refusals_print_nothing_first(refused):
    """A bad --kv is refused before the model loads or a table header prints."""
    results, _ = refused
    assert "loading" not in results["generate-bad-kv"][1].stderr
    for case in ("capacity-bad-kv", "demo-bad-format", "capacity-reserve-no-unit"):
        assert results[case][1].stdout == "", case


def test_quality_run_left_untouched(refused):
    """--resume on a quality run once appended bench rows and overwrote its report."""
    results, root = refused
    q = root / "quality-run"
    assert (q / "rows.jsonl").read_text() == "" and not (q / "report.md").exists()
    assert json.loads((q / "config.json").read_text())["kind"] == "quality"


def test_generate_positional_model_is_deprecated_but_runs():
    proc = kvtax_cli("generate", "tiny", "--max-tokens", "2", "--threads", "1",
                     "--no-cuda-graph")
    assert proc.returncode == OK, proc.stderr
    assert "positional model is deprecated; use --model tiny" in proc.stderr
    assert "generated 2" in proc.stdout


def test_version_and_debug():
    proc = kvtax_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"kvtax {version()}"
    proc = kvtax_cli("--debug", "bench", "--model", "/nonexistent")
    assert proc.returncode == BAD_INPUT and "Traceback" in proc.stderr
    assert "ModelNotFoundError" in proc.stderr


def test_unexpected_errors_are_one_line_and_exit_4(monkeypatch, capsys):
    """A bug inside a command prints one line pointing at --debug, not a traceback."""
    from kvtax.cli import demo

    def boom(args):  # noqa: ANN001, ANN202
        raise ValueError("boom")

    monkeypatch.setattr(demo, "run", boom)  # register() binds `run` when main builds parsers
    assert main(["demo"]) == UNEXPECTED
    err = capsys.readouterr().err.strip()
    assert err == ("kvtax demo: unexpected error: ValueError: boom "
                   "(run with --debug for the traceback)")
    assert main(["--debug", "demo"]) == UNEXPECTED
    assert "Traceback" in capsys.readouterr().err


def test_help_documents_exit_codes():
    proc = kvtax_cli("recall", "--help")
    assert proc.returncode == 0
    assert "exit status:" in proc.stdout and "3    some work failed" in proc.stdout


def test_bench_all_failed_exits_1_and_so_does_its_report(tmp_path):
    """`kvtax bench` once exited 0 with 0 of 130 cells measured; `report` did too."""
    proc = kvtax_cli("bench", "--kv", "fp16", "--paths", "fused", "--contexts", "64", *FAST,
                     "--force-oom", "setup", "--no-report", "--out", str(tmp_path))
    assert proc.returncode == ALL_FAILED, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("kvtax bench: 0 of 1 cells measured; 1 failed: oom in setup: ")
    assert "Traceback" not in proc.stderr
    (run,) = tmp_path.iterdir()
    proc = kvtax_cli("report", str(run))
    assert proc.returncode == ALL_FAILED, proc.stderr
    assert "0 of 1 rows measured; 1 failed" in proc.stderr
    assert (run / "report.md").exists()


def test_bench_partial_failure_exits_3(tmp_path):
    proc = kvtax_cli("bench", "--kv", "fp16,int8", "--paths", "fused", "--contexts", "64",
                     *FAST, "--force-oom", "setup:int8", "--no-report", "--out", str(tmp_path))
    assert proc.returncode == SOME_FAILED, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "kvtax bench: 1 of 2 cells measured; 1 failed: oom in setup: ")
