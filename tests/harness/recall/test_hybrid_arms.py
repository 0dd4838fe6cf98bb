"""Hybrid (`int4+hk@s4r16`) and per-layer (`int8:L0=fp16`) caches through the normal path:
the Runner, the recall session and `kvtax recall` (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from kvtax.cache import make_caches
from kvtax.cache.hybrid import HybridCache
from kvtax.cli import main as cli_main
from kvtax.harness.recall.models import load_recall_model
from kvtax.harness.schema import validate_row
from kvtax.harness.store import RunStore, read_rows
from kvtax.models import Runner

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


@pytest.fixture(scope="module")
def tiny():
    m = load_recall_model("tiny", seed=2)
    m.chunk_size = 32  # small rings, so the fp16 ring wraps inside a 300-token document
    return m


def test_runner_builds_hybrid_caches_and_decodes_eagerly(tiny) -> None:
    """The Runner's caches are HybridCaches, its chunked prefill equals one whole forward
    over fresh caches of the factory, and generation runs without a CUDA graph."""
    net = tiny.model
    runner = Runner(net, "int4+hk@s4r16", chunk_size=32)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(0))
    caches = runner.make_caches()
    assert all(isinstance(c, HybridCache) for c in caches)
    logits = runner.prefill(ids, caches)
    fresh = make_caches(net.config.layer_windows(), "int4+hk@s4r16", max_chunk=90)
    want = net(ids, fresh, torch.arange(90))[:, -1].float()
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    out = runner.generate(ids, 5, ignore_eos=True)
    assert len(out.tokens) == 5 and not out.cuda_graph


def test_session_keeps_the_document_after_the_ring_wrapped(tiny) -> None:
    """Questions after one shared 300-token document: the hybrid caches are trimmed back
    (their fp16 ring of 8 - 1 + 32 slots wrapped long ago), not prefilled again, and the
    next question sees what a fresh prefill of its whole prompt sees."""
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 256, (300,), generator=gen).tolist()
    q1, q2 = (torch.randint(0, 256, (10,), generator=gen).tolist() for _ in range(2))
    session = tiny.session("int4+hk@s2r8", "fused", prefix, 400)
    assert len(session.ask(q1, 3)) == 3
    assert all(isinstance(c, HybridCache) for c in session.caches)
    reused = session.runner.prefill(torch.tensor([q2]), session.caches)
    assert session.prefills == 1
    fresh = tiny.session("int4+hk@s2r8", "fused", [], 400)
    fresh._prefill_prefix()
    want = fresh.runner.prefill(torch.tensor([prefix + q2]), fresh.caches)
    assert (reused - want).abs().max() < 1e-4


def test_kvtax_recall_runs_hybrid_and_per_layer_arms(tmp_path, capsys) -> None:
    """`kvtax recall` serves hybrid and per-layer arms itself; rows keep the arm as `kv`."""
    assert cli_main(["recall", "--model", "tiny", "--contexts", "400", "--facts", "2", "--kv",
                     "int4+hk@s2r16,fp16,int8:L0=fp16", "--max-new-tokens", "2",
                     "--out", str(tmp_path)]) == 0
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = read_rows(run)
    assert [r["kv"] for r in rows] == ["fp16"] * 2 + ["int4+hk@s2r16"] * 2 + ["int8:L0=fp16"] * 2
    for r in rows:
        validate_row(r)
        assert r["status"] == "ok", r.get("error")
        assert r["arm"] == f"{r['kv']}/fused"
    assert RunStore.open(run).config()["command"].startswith("kvtax recall")
    assert "## Recall" in (run / "report.md").read_text()


@pytest.mark.parametrize("kv, says", [
    ("int4@x", "after '@'"),
    ("int8+hk/L0:fp16", "'int8+hk:L0=fp16'"),  # the older spelling names the new one
])
def test_kvtax_recall_refuses_bad_arms_in_one_line(tmp_path, capsys, kv, says) -> None:
    assert cli_main(["recall", "--model", "tiny", "--kv", kv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_hf_engine_refuses_hybrid_arms(tmp_path, capsys) -> None:
    assert cli_main(["recall", "--engine", "hf", "--model", "tiny", "--kv",
                     "fp16,int4@r16", "--out", str(tmp_path)]) == 2
    assert "need the kvtax engine" in capsys.readouterr().err


def test_hybrid_without_exempt_tokens_is_the_plain_format(tiny) -> None:
    """`int4+hk@s0r0` has no fp16 part: greedy tokens and logits equal plain int4+hk's, so
    any recall difference of a hybrid arm comes from its fp16 tokens, not the plumbing."""
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(4))
    plain = Runner(tiny.model, kv="int4+hk", chunk_size=32)
    hybrid = Runner(tiny.model, "int4+hk@s0r0", chunk_size=32)
    a, b = plain.make_caches(), hybrid.make_caches()
    assert isinstance(b[0], HybridCache)
    torch.testing.assert_close(hybrid.prefill(ids, b), plain.prefill(ids, a), atol=1e-5,
                               rtol=1e-5)
    assert (hybrid.generate(ids, 6, ignore_eos=True).tokens
            == plain.generate(ids, 6, ignore_eos=True).tokens)


def test_per_layer_arm_equals_the_runner_overrides(tiny) -> None:
    """The recall session of `int8:L0=fp16` runs Runner(overrides={0: "fp16"}): same caches,
    same logits; and a hybrid base takes overrides too."""
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(5))
    plain = Runner(tiny.model, kv="int8", overrides={0: "fp16"}, chunk_size=32)
    layered = tiny.session("int8:L0=fp16", "fused", [], 100).runner
    a, b = plain.make_caches(), layered.make_caches()
    assert [c.spec.name for c in b] == [c.spec.name for c in a] and b[0].spec.name == "fp16"
    assert b[1].spec.name == "int8"
    torch.testing.assert_close(layered.prefill(ids, b), plain.prefill(ids, a), atol=1e-5,
                               rtol=1e-5)
    mixed = tiny.session("int4+hk@s4r16:L1=fp16", "fused", [], 100).runner.make_caches()
    assert isinstance(mixed[0], HybridCache) and mixed[1].spec.name == "fp16"


def test_recall_arm_with_layer_formats_resolves_to_the_kvtax_path(tiny) -> None:
    assert tiny.resolve("int8+hk:L0=fp16:L8=fp16") == ("int8+hk:L0=fp16:L8=fp16", "fused")
    assert tiny.resolve("int8+hk:L0=fp16/fused") == ("int8+hk:L0=fp16", "fused")
    assert tiny.resolve("int8/fused") == ("int8", "fused")
    with pytest.raises(ValueError, match="fused path only"):
        tiny.resolve("int8/hf-quantized")
