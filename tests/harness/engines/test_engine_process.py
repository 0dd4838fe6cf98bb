"""Engines marked `isolated` run in a child process that never imports torch
(engines.process / engines.isolated): a CUDA build of llama-cpp-python 0.3.36 segfaulted in
model load in any process that had imported torch 2.11 (H200, 2026-12-03).

The plumbing is checked on a torch-free echo engine (tests/support/echo_engine.py): errors
come back as the same type and message, a crash becomes one KVTaxError naming the signal,
callbacks run in the parent, the child dies with its parent. llama.cpp itself is checked on
SmolLM2-135M's GGUF: no torch in its process, and the same numbers as in process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtax.errors import KVTaxError
from kvtax.harness.engines import EngineSpec, EngineUnavailable, get_engine
from kvtax.harness.engines.process import EngineProcess, open_engine
from tests.support.echo_engine import EchoEngine
from tests.support.engine_env import ROOT, SRC



@pytest.fixture
def echo_env(monkeypatch):
    """The child can import tests.support.echo_engine."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


@pytest.fixture
def procs():
    made: list[EngineProcess] = []
    yield made
    for p in made:
        p.close()


def _echo(procs: list, **options) -> EngineProcess:
    eng = open_engine(EchoEngine, EngineSpec(model="m", kv="f16", path="a", options=options))
    assert isinstance(eng, EngineProcess)
    procs.append(eng)
    return eng


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0) until it is reaped: read its state
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_llamacpp_module_imports_without_torch() -> None:
    """What the child imports for llama.cpp, and kvtax itself, leave torch out; the lazy
    public names still resolve, `kvtax.attention` the function after its subpackage loads."""
    code = ("import sys, kvtax, kvtax.harness.engines.llamacpp, "
            "kvtax.harness.engines.isolated\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "import kvtax.cache\n"
            "from kvtax import attention, FullCache\n"
            "assert callable(attention) and not isinstance(attention, type(sys))\n"
            "assert kvtax.attention is attention\n"
            "assert all(getattr(kvtax, n) is not None for n in kvtax.__all__)\n")
    env = dict(os.environ, PYTHONPATH=str(SRC))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_only_isolated_engines_get_a_process(echo_env, procs) -> None:
    assert get_engine("llama.cpp").isolated and not get_engine("kvtax").isolated
    eng = _echo(procs)
    assert eng.facts["pid"] != os.getpid() and eng.facts["torch_imported"] is False
    assert int(eng.version().split()[1]) == eng.facts["pid"]


def test_calls_reach_the_engine_and_back(echo_env, procs) -> None:
    eng = _echo(procs)
    eng.load()
    assert eng.info() == {"loaded": True, "torch_imported": False}
    assert eng.tokenize("hi") == [104, 105] and eng.detokenize([104, 105]) == "hi"
    assert eng.prefix_ids() == [2]
    assert getattr(eng, "render_chat", None) is None  # the engine has none: neither has its proxy
    ids = list(range(10))
    assert np.array_equal(eng.logits(ids, 3), EchoEngine(eng.spec).logits(ids, 3))
    lp = eng.logprobs(ids, 3)
    assert lp.dtype == torch.float32 and lp.shape == (3, 16)
    torch.testing.assert_close(lp, EchoEngine(eng.spec).logprobs(ids, 3), rtol=0, atol=0)


def test_stop_callback_runs_in_the_parent(echo_env, procs) -> None:
    eng = _echo(procs)
    seen: list[str] = []

    def stop(text: str) -> bool:
        seen.append(text)
        return text.endswith("\n")

    assert eng.detokenize(eng.generate(eng.tokenize("ab\ncd"), 10, stop=stop)) == "ab\n"
    assert seen == ["a", "ab", "ab\n"]


def test_a_failing_stop_callback_raises_here_and_the_child_goes_on(echo_env, procs) -> None:
    eng = _echo(procs)

    def stop(text: str) -> bool:
        raise LookupError(f"no stop for {text!r}")

    with pytest.raises(LookupError, match="no stop for 'a'"):
        eng.generate([97, 98], 5, stop=stop)
    assert eng.generate([97, 98], 5) == [97, 98]


def test_errors_come_back_as_the_same_type_and_message(echo_env, procs) -> None:
    with pytest.raises(KVTaxError) as bad:
        open_engine(EchoEngine, EngineSpec(model="m", kv="bad_kv", path="a"))
    assert str(bad.value) == "echo: unknown kv 'bad_kv'; use f16" and type(bad.value) is KVTaxError
    eng = _echo(procs, refuse="no room")
    with pytest.raises(EngineUnavailable) as refused:
        eng.load()
    assert str(refused.value) == "echo refused arm f16/a: no room"
    with pytest.raises(ValueError) as builtin:
        eng.logits([1, 2], 9)
    assert str(builtin.value) == "tail 9 must be in 1..1"  # the child's traceback is a note
    assert "echo_engine.py" in builtin.value.__notes__[0]
    assert eng.tokenize("x") == [120]  # the child is still serving


def test_a_crashed_child_is_one_error_naming_the_signal(echo_env, procs) -> None:
    eng = _echo(procs, crash=True)
    t0 = time.monotonic()
    with pytest.raises(KVTaxError) as died:
        eng.load()
    assert str(died.value) == (f"engine echo's process (pid {eng.facts['pid']}) killed by "
                               f"signal SIGSEGV during load")
    assert time.monotonic() - t0 < 30
    eng.close()  # quiet: a close in a finally block must not hide the crash
    assert eng.proc.returncode == -signal.SIGSEGV


def test_close_ends_the_child(echo_env, procs) -> None:
    eng = _echo(procs)
    pid = eng.facts["pid"]
    eng.close()
    assert eng.proc.returncode == 0 and not _alive(pid)


def test_the_child_dies_with_its_parent(echo_env, tmp_path) -> None:
    """A parent killed mid-call (the child busy, so no end-of-input) takes its child along."""
    code = ("import sys\n"
            "from kvtax.harness.engines import EngineSpec\n"
            "from kvtax.harness.engines.process import open_engine\n"
            "from tests.support.echo_engine import EchoEngine\n"
            "eng = open_engine(EchoEngine, EngineSpec(model='m', kv='f16', path='a', "
            "options={'sleep': 120}))\n"
            "print(eng.facts['pid'], flush=True)\n"
            "eng.load()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(SRC),
                                                       os.environ.get("PYTHONPATH", "")]))
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


# ----------------------------------------------------------------------------- llama.cpp




def _spec(gguf: str, kv: str = "q8_0", path: str = "fa") -> EngineSpec:
    return EngineSpec(model=gguf, kv=kv, path=path, threads=2, chunk_size=64, capacity=128)


def test_llamacpp_runs_without_torch_and_matches_in_process(gguf: str, procs) -> None:
    """The child never has torch, even after load, logits and generation; its log-probs
    and greedy tokens are exactly the in-process engine's."""
    iso = open_engine(get_engine("llama.cpp"), _spec(gguf))
    procs.append(iso)
    iso.load()
    local = get_engine("llama.cpp")(_spec(gguf))
    try:
        local.load()
        ids = iso.prefix_ids() + iso.tokenize("The capital of France is Paris. The capital "
                                              "of Italy is")
        assert ids == local.prefix_ids() + local.tokenize("The capital of France is Paris. "
                                                          "The capital of Italy is")
        torch.testing.assert_close(iso.logprobs(ids, 8), local.logprobs(ids, 8), rtol=0, atol=0)
        assert iso.generate(ids, 8) == local.generate(ids, 8)
        assert iso.render_chat("hi") == local.render_chat("hi")
        assert iso.cache_bytes() == local.cache_bytes()
    finally:
        local.close()
    assert iso.child_facts()["torch_imported"] is False


def test_llamacpp_refusals_keep_their_messages(gguf: str, procs) -> None:
    cls = get_engine("llama.cpp")
    for spec in (_spec("/no/such.gguf"), _spec(gguf, kv="q8_0", path="nofa")):
        eng = cls(spec)
        with pytest.raises(KVTaxError) as local:
            eng.load()
        eng.close()
        iso = open_engine(cls, spec)
        procs.append(iso)
        with pytest.raises(KVTaxError) as there:
            iso.load()
        assert (type(there.value), str(there.value)) == (type(local.value), str(local.value))


def test_quality_and_recall_commands_run_llamacpp_isolated(gguf: str, tmp_path: Path) -> None:
    """`kvtax quality` / `kvtax recall --engine llama.cpp`: rows as before, from a process
    that has torch (this one) driving a child that does not."""
    from kvtax.cli import main
    from kvtax.harness.store import read_rows

    assert main(["quality", "--engine", "llama.cpp", "--model", gguf, "--contexts", "64",
                 "--kv", "f16,q8_0", "--tail", "8", "--threads", "2",
                 "--out", str(tmp_path / "q"), "--no-report"]) == 0
    (run,) = (tmp_path / "q").iterdir()
    rows = {r["arm"]: r for r in read_rows(run)}
    assert {a: r["status"] for a, r in rows.items()} == {"f16/fa": "ok", "q8_0/fa": "ok"}
    assert rows["f16/fa"]["kl"] == 0 and 0 < rows["q8_0/fa"]["kl"] < 0.1
    assert main(["recall", "--engine", "llama.cpp", "--model", gguf, "--contexts", "256",
                 "--kv", "f16", "--facts", "1", "--max-new-tokens", "24",
                 "--out", str(tmp_path / "r"), "--no-report"]) == 0
    (run,) = (tmp_path / "r").iterdir()
    (row,) = read_rows(run)
    assert row["status"] == "ok" and row["engine_version"].startswith("llama-cpp-python ")
