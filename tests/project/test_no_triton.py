"""CPU paths without Triton: the README's `pip install -e '.[report]'` brings no Triton.

Regression: `kvtax bench` measured 0 of 130 cells in such an environment (every cell failed
with `No module named 'triton'`: kvtax.models.argmax imported it at the top), `capacity`
died with a traceback and `roofline` said `unknown model 'llama-3.1-8b'`. Each check runs
in a fresh interpreter whose `sitecustomize` makes `import triton` fail, as it does where
Triton is not installed; the bench's worker processes start with the same sitecustomize.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvtax

BLOCK = "import sys\nsys.modules['triton'] = None  # `import triton` raises ImportError\n"
SRC = str(Path(kvtax.__file__).resolve().parents[1])


@pytest.fixture
def no_triton_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), SRC, env.get("PYTHONPATH", "")])
    return env


def _run(env: dict[str, str], code: str, *args: str, cwd: Path | None = None,
         timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd, text=True,
                          capture_output=True, timeout=timeout)


CLI = "from kvtax.cli import main; raise SystemExit(main())"


def test_the_block_works(no_triton_env):
    """The environment really has no Triton (else the checks below prove nothing)."""
    r = _run(no_triton_env, "import triton")
    assert r.returncode != 0 and "import of triton halted" in r.stderr


def test_library_attention_and_generate_without_triton(no_triton_env):
    code = """
import sys, torch
from kvtax import FullCache, attention
from kvtax.models import Runner, load_model
torch.manual_seed(0)
k, v = torch.randn(2, 1, 2, 33, 64).unbind(0)
cache, exact = FullCache("int8+hk+ck"), FullCache("fp32")
cache.append(k, v)
exact.append(k, v)
q = torch.randn(1, 4, 3, 64)
err = (attention(q, cache.view()) - attention(q, exact.view())).abs().max()
assert 0 < err < 0.05, err  # int8's rounding, not a wrong answer
runner = Runner(load_model("tiny"))
res = runner.generate(torch.randint(0, 200, (1, 12)), max_new_tokens=4)
assert len(res.tokens) == 4, res.tokens
assert "triton" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
print("OK")
"""
    r = _run(no_triton_env, code)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout


def test_capacity_and_roofline_without_triton(no_triton_env, tmp_path):
    r = _run(no_triton_env, CLI, "capacity", "--model", "llama-3.1-8b", "--reserve", "13.37GiB")
    assert r.returncode == 0, r.stderr
    assert "109,527" in r.stdout and "Traceback" not in r.stderr
    r = _run(no_triton_env, CLI, "roofline", "--device", "cpu", "--contexts", "128",
             "--kv", "int8", "--paths", "fused", "--iters", "1", "--stream-bytes", "4MiB",
             "--out", str(tmp_path / "runs"))
    assert r.returncode == 0, r.stderr
    (run,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(x) for x in (run / "rows.jsonl").read_text().splitlines()]
    att = [x for x in rows if x.get("op") == "attention"]
    assert att and all(x["status"] == "ok" for x in att), att


def test_bench_cells_measure_without_triton(no_triton_env, tmp_path):
    r = _run(no_triton_env, CLI, "bench", "--contexts", "128", "--kv", "int8,fp8-pt",
             "--paths", "fused,fp16", "--reps", "1", "--warmup", "0", "--decode-tokens", "2",
             "--out", str(tmp_path / "runs"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (run,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(x) for x in (run / "rows.jsonl").read_text().splitlines()]
    assert {x["arm"] for x in rows} == {"int8/fused", "fp8-pt/fused", "fp16/fp16"}
    per = {x["arm"]: x["bytes_per_token"] for x in rows}
    assert per["fp8-pt/fused"] * 2 == per["fp16/fp16"] < per["int8/fused"] * 2  # 1 B/element
    assert all(x["status"] == "ok" for x in rows), [x.get("error") for x in rows]


def test_cpu_paths_load_no_kernel_module():
    """Where Triton is installed, CPU work still imports none of kvtax's kernel modules
    (greedy sampling asked kvtax.models.argmax whether its kernel runs, which imported it)."""
    code = """
import sys, torch
from kvtax import FullCache, attention
from kvtax.models import Runner, load_model
Runner(load_model("tiny")).generate(torch.randint(0, 200, (1, 8)), max_new_tokens=3)
cache = FullCache("int8+hk+ck")
cache.append(*torch.randn(2, 1, 2, 9, 64).unbind(0))
attention(torch.randn(1, 4, 1, 64), cache.view())
print(sorted(m for m in sys.modules if m.startswith("kvtax") and
             ("kernels" in m or m.endswith(("triton_api", "store_triton", "gemv")))))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    r = _run(env, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
