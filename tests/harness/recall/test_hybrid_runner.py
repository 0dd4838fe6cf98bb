"""Hybrid specs through the runner and the recall probe (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from kvtax.cache.hybrid import HybridCache
from kvtax.harness.recall.hybrid_runner import (
    PROG,
    HybridRecallModel,
    HybridRunner,
    hybrid_attention_installed,
    main,
)
from kvtax.harness.quality.probe import build_caches
from kvtax.harness.recall.models import load_recall_model
from kvtax.harness.schema import validate_row
from kvtax.harness.store import RunStore, read_rows
from kvtax.models import Runner

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


@pytest.fixture(scope="module")
def tiny():
    m = load_recall_model("tiny", seed=2)
    m.chunk_size = 32  # small rings, so the fp16 ring wraps inside a 300-token document
    return HybridRecallModel.wrap(m)


def test_runner_generates_and_restores_attention(tiny) -> None:
    net = tiny.model
    before = [layer.attn.attn_fn for layer in net.layers]
    runner = HybridRunner(net, "int4+hk@s4r16", chunk_size=32)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(0))
    caches = runner.make_caches()
    assert all(isinstance(c, HybridCache) for c in caches)
    logits = runner.prefill(ids, caches)
    assert [layer.attn.attn_fn for layer in net.layers] == before
    with hybrid_attention_installed(net):  # one whole forward over fresh caches agrees
        fresh = build_caches(net.config.layer_windows(), "int4+hk@s4r16", None, 90)
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
    reused = session.runner.prefill(torch.tensor([q2]), session.caches)
    assert session.prefills == 1
    fresh = tiny.session("int4+hk@s2r8", "fused", [], 400)
    fresh._prefill_prefix()
    want = fresh.runner.prefill(torch.tensor([prefix + q2]), fresh.caches)
    assert (reused - want).abs().max() < 1e-4


def test_recall_entry_point_runs_hybrid_arms(tmp_path, capsys) -> None:
    assert main(["--model", "tiny", "--contexts", "400", "--facts", "2", "--kv",
                 "int4+hk@s2r16,fp16", "--max-new-tokens", "2", "--out", str(tmp_path)]) == 0
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = read_rows(run)
    assert [r["kv"] for r in rows] == ["fp16", "fp16", "int4+hk@s2r16", "int4+hk@s2r16"]
    for r in rows:
        validate_row(r)
        assert r["status"] == "ok", r.get("error")
    assert RunStore.open(run).config()["command"].startswith(PROG)
    assert "## Recall" in (run / "report.md").read_text()
    with pytest.raises(ValueError, match="after '@'"):
        main(["--model", "tiny", "--kv", "int4@x", "--out", str(tmp_path)])


def test_hybrid_without_exempt_tokens_is_the_plain_format(tiny) -> None:
    """`int4+hk@s0r0` has no fp16 part: greedy tokens and logits equal plain int4+hk's, so
    any recall difference of a hybrid arm comes from its fp16 tokens, not the plumbing."""
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(4))
    plain = Runner(tiny.model, kv="int4+hk", chunk_size=32)
    hybrid = HybridRunner(tiny.model, "int4+hk@s0r0", chunk_size=32)
    a, b = plain.make_caches(), hybrid.make_caches()
    torch.testing.assert_close(hybrid.prefill(ids, b), plain.prefill(ids, a), atol=1e-5,
                               rtol=1e-5)
    assert (hybrid.generate(ids, 6, ignore_eos=True).tokens
            == plain.generate(ids, 6, ignore_eos=True).tokens)


def test_per_layer_formats_equal_the_runner_overrides(tiny) -> None:
    """`int8/L0:fp16` (recall and quality arms) builds what Runner(overrides={0: "fp16"})
    builds: same logits, same greedy tokens; and a hybrid arm takes overrides too."""
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(5))
    plain = Runner(tiny.model, kv="int8", overrides={0: "fp16"}, chunk_size=32)
    layered = HybridRunner(tiny.model, "int8/L0:fp16", chunk_size=32)
    a, b = plain.make_caches(), layered.make_caches()
    assert [c.spec.name for c in b] == [c.spec.name for c in a] and b[0].spec.name == "fp16"
    torch.testing.assert_close(layered.prefill(ids, b), plain.prefill(ids, a), atol=1e-5,
                               rtol=1e-5)
    assert (layered.generate(ids, 6, ignore_eos=True).tokens
            == plain.generate(ids, 6, ignore_eos=True).tokens)
    mixed = HybridRunner(tiny.model, "int4+hk@s4r16/L1:fp16", chunk_size=32).make_caches()
    assert isinstance(mixed[0], HybridCache) and mixed[1].spec.name == "fp16"


def test_recall_arm_with_layer_formats_resolves_to_the_kvtax_path(tiny) -> None:
    assert tiny.resolve("int8+hk/L0:fp16/L8:fp16") == ("int8+hk/L0:fp16/L8:fp16", "fused")
    assert tiny.resolve("int8/fused") == ("int8", "fused")
    with pytest.raises(ValueError, match="fused path only"):
        tiny.resolve("int8/hf-quantized")
