"""The suite's interpreter and device setup, done once for every test file.

Markers (registered in pyproject.toml):
- `gpu`: needs a CUDA device; skipped (with the reason) on a machine without one.
- `kernels`: launches kvtax's Triton kernels: compiled on a CUDA device, else through
  Triton's interpreter on CPU tensors (how CI checks them); skipped without Triton.

`triton.jit` decides between compiling and interpreting when a kernel is decorated, so
on a machine without CUDA this module builds every kvtax module that defines a
`@triton.jit` kernel under `TRITON_INTERPRET=1` before any test module imports kvtax,
then restores the variable (it must not reach the processes CLI tests start).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.support.device import HAS_CUDA, HAS_TRITON

_JIT = re.compile(r"^@triton\.jit\b|\btriton\.jit\(", re.MULTILINE)
# how `import triton` fails where it is not installed (or blocked, as in test_no_triton)
_NO_TRITON = re.compile(r"ModuleNotFoundError: (No module named 'triton|import of triton\b)")


def kernel_modules() -> list[str]:
    """Names of the kvtax modules that define `@triton.jit` kernels, read from the source
    (Gluon kernels are left out: they do not run in the interpreter and load lazily)."""
    spec = importlib.util.find_spec("kvtax")
    root = Path(next(iter(spec.submodule_search_locations)))
    names = []
    for path in sorted(root.rglob("*.py")):
        if _JIT.search(path.read_text(encoding="utf-8")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def build_interpreted(names: list[str]) -> None:
    """(Re)import the modules `names` with TRITON_INTERPRET=1 on a machine without CUDA,
    so their kernels run interpreted on CPU tensors; the variable is restored after and
    set again only while a `kernels` test runs (`interpret_mode`). With CUDA: nothing."""
    if HAS_CUDA or not HAS_TRITON:
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _interpret_triton_helpers()
        for name in names:
            if name in sys.modules:  # imported earlier in compiled mode: rebuild
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _interpret_triton_helpers() -> None:
    """Triton's own `@jit` helpers (tl.sum, tl.max, tl.cdiv, ...) as interpreted twins.

    They are built when triton is first imported: interpreted if that happens here (the
    usual case), compiled-mode if something imported triton earlier; interpreted kernels
    cannot call compiled-mode helpers, so those are swapped for the whole run (on CPU the
    compiled ones cannot run anyway). Gluon, which wraps them, is imported here too: the
    interpreter imports it at its first launch, perhaps in a test without the mode.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name in dir(tl):
        fn = getattr(tl, name)
        if isinstance(fn, JITFunction):
            setattr(tl, name, InterpretedFunction(fn.fn))
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:  # a Triton without Gluon
        pass


build_interpreted(kernel_modules())  # conftest runs before any test module is imported


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    """Skip `gpu` tests without CUDA and `kernels` tests without Triton, saying why."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA device (gpu mark)")
    no_triton = pytest.mark.skip(reason="needs triton (kernels mark)")
    for item in items:
        if not HAS_CUDA and item.get_closest_marker("gpu"):
            item.add_marker(no_gpu)
        if not HAS_TRITON and item.get_closest_marker("kernels"):
            item.add_marker(no_triton)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):  # noqa: ANN001
    """Without Triton, a test module that imports kvtax's kernel modules is reported as
    skipped (its tests need the kernels) rather than as a collection error."""
    report = yield
    if (not HAS_TRITON and report.failed and isinstance(collector, pytest.Module)
            and _NO_TRITON.search(str(report.longrepr))):
        report.outcome, report.result = "skipped", []
        report.longrepr = (str(collector.path), 0, "Skipped: needs triton (imports kvtax's kernels)")
    return report


@pytest.fixture(autouse=True)
def interpret_mode(request, monkeypatch):  # noqa: ANN001
    """TRITON_INTERPRET=1 for the length of one `kernels` test (CPU only): Triton's
    interpreter reads it at launch too (constexpr functions). Other tests run without it,
    so the processes they start build kvtax's kernels as a user's would."""
    if not HAS_CUDA and request.node.get_closest_marker("kernels") is not None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (`pytest.mark.usefixtures("one_thread")`).

    Tiny shapes gain nothing from intra-op threads, and on a busy 2-core runner two threads
    per op ran ~15x slower than one (measured: 863 vs 55 ms per tiny-gemma3 decode step).
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
