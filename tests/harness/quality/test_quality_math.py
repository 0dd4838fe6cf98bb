"""`kvtax quality` math and plumbing on known inputs and tiny random models (fast, no
downloads): KL / NLL / top-1 against hand-computed values, one teacher-forced pass equal
to a whole-sequence forward whatever the chunking, the layer-error probe, input errors,
resume and the report section."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvtax.cache import make_caches
from kvtax.cli import main as cli_main
from kvtax.errors import FormatError
from kvtax.harness.kv_arm import parse_arm
from kvtax.harness.quality.probe import (
    QualityConfig,
    QualityInputError,
    check_config,
    measure,
    run_quality,
    score_pass,
    text_fingerprint,
    text_ids,
    text_of,
)
from kvtax.harness.quality.metrics import (
    LayerErrorProbe,
    TailStats,
    kl_divergence,
    log_probs,
    nll,
    top1_agree,
)
from kvtax.harness.quality.tables import quality_text_table, section_quality
from kvtax.harness.recall.models import load_recall_model
from kvtax.harness.text import ByteTextTokenizer
from kvtax.harness.schema import validate_row
from kvtax.harness.store import read_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


def test_kl_matches_hand_computed_values() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.9, 0.05, 0.05], [0.2, 0.3, 0.5]])
    kl = kl_divergence(p.log(), q.log())
    want = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.05)  # the 0 · log 0 term is 0
    assert kl[0].item() == pytest.approx(want, rel=1e-6)
    assert kl[1].item() == 0.0
    logits_p, logits_q = torch.randn(5, 40), torch.randn(5, 40)
    torch_kl = F.kl_div(log_probs(logits_q), log_probs(logits_p), log_target=True,
                        reduction="none").sum(-1)
    assert torch.allclose(kl_divergence(log_probs(logits_p), log_probs(logits_q)),
                          torch_kl.double(), atol=1e-6)


def test_nll_top1_and_summary() -> None:
    v = 37
    uniform = torch.zeros(4, v)
    assert torch.allclose(nll(uniform, torch.tensor([0, 3, 5, 36])),
                          torch.full((4,), math.log(v), dtype=torch.float64))
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    assert nll(logits, torch.tensor([1, 2]))[1].item() == pytest.approx(
        math.log(math.exp(3) + 2) - 0.0)
    assert top1_agree(log_probs(logits), log_probs(logits.flip(0))).tolist() == [False, False]
    s = TailStats(kl=[0.1, 0.3], agree=[True, False], tail_nll=[math.log(4), math.log(16)],
                  full_nll_sum=3 * math.log(8), full_count=3)
    out = s.summary()
    assert out["kl"] == pytest.approx(0.2) and out["kl_max"] == pytest.approx(0.3)
    assert out["kl_sem"] == pytest.approx(0.1)  # std 0.1414 / sqrt(2)
    assert out["top1"] == 0.5 and out["ppl"] == pytest.approx(8.0)
    assert out["ppl_full"] == pytest.approx(8.0) and out["tokens_scored"] == 2


@pytest.fixture(scope="module")
def tiny():
    return load_recall_model("tiny", seed=3)


@pytest.fixture(scope="module")
def gemma():
    return load_recall_model("tiny-gemma3", seed=4)


def _ids(n: int, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n + 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["tiny", "gemma"])
def test_pass_equals_one_forward_whatever_the_chunking(name, request) -> None:
    """Perplexity of a chunked pass = NLL of one whole-sequence forward (fp32 KV); a pass
    against its own log-probabilities has KL exactly 0 and top-1 1."""
    net = request.getfixturevalue(name).model
    windows = net.config.layer_windows()
    ids, c = _ids(150), 150
    whole = net(ids[:, :c], make_caches(windows, "fp32", max_chunk=c), torch.arange(c),
                last_only=False)[0]
    want = nll(whole, ids[0, 1:])
    for chunk in (150, 37):
        stats, ref = score_pass(net, make_caches(windows, "fp32", max_chunk=chunk), ids,
                                chunk=chunk, tail=20)
        assert ref is not None and ref.shape == (20, net.config.vocab_size)
        assert stats.full_count == c
        assert stats.summary()["ppl_full"] == pytest.approx(math.exp(want.mean().item()),
                                                            rel=1e-5)
        assert stats.tail_nll == pytest.approx(want[-20:].tolist(), rel=1e-4, abs=1e-5)
        again, _ = score_pass(net, make_caches(windows, "fp32", max_chunk=chunk), ids,
                              chunk=chunk, tail=20, ref_logp=ref)
        # fp32 KV, same chunking: identical arithmetic, so exactly zero.
        assert max(again.kl) == 0.0 and all(again.agree)


def test_probe_measures_each_layer_and_undoes_itself(gemma) -> None:
    """fp16 run vs its fp16 shadow: zero error in every layer; int4: nonzero in every
    layer (sliding and global), larger than int8's; attn_fn restored after."""
    net = gemma.model
    windows = net.config.layer_windows()
    ids = _ids(130, seed=1)
    before = [layer.attn.attn_fn for layer in net.layers]
    errs = {}
    for kv in ("fp16", "int8", "int4"):
        probe = LayerErrorProbe(net, make_caches(windows, "fp16", max_chunk=64), 130 - 16)
        with probe:
            score_pass(net, make_caches(windows, kv, max_chunk=64), ids, chunk=64, tail=16,
                       probe=probe)
        errs[kv] = probe.layer_errors()
        heads = probe.head_errors()
        assert len(heads) == len(windows) and all(len(h) == net.config.num_heads for h in heads)
    assert [layer.attn.attn_fn for layer in net.layers] == before
    assert all(e == 0.0 for e in errs["fp16"])
    assert all(0 < a < b for a, b in zip(errs["int8"], errs["int4"]))


def test_input_errors(tiny) -> None:
    for bad, match in (
        (QualityConfig(contexts=[1]), "contexts"),
        (QualityConfig(contexts=[64], tail=65), "tail"),
        (QualityConfig(contexts=[64], tail=0), "tail"),
        (QualityConfig(contexts=[64], tail=8, text="/nonexistent/x.txt"), "no such file"),
        (QualityConfig(contexts=[64], tail=8, baseline="int4@s4"), "baseline"),
    ):
        with pytest.raises(QualityInputError, match=match):
            check_config(bad)
    with pytest.raises(ValueError, match="unknown KV format"):
        check_config(QualityConfig(contexts=[64], tail=8, kvs=["int5"]))
    with pytest.raises(QualityInputError, match="longer --text"):
        text_ids(ByteTextTokenizer(), "short text", 100)
    assert text_ids(ByteTextTokenizer(), "abcdef" * 3000, 10) == [256] + list(b"abcdefabc")


def test_layer_overrides_build_those_layers_in_their_format() -> None:
    """`FMT:L<i>=<format>` arms keep the named layers in another format (the lever the
    per-layer error table points at); bad overrides are refused with the reason, and the
    older `FMT/L<i>:<format>` spelling is refused naming the new one."""
    arm = parse_arm("int8+hk:L0=fp16:L2=int4")
    caches = make_caches([None, 512, None], arm.base, overrides=arm.layers, max_chunk=64)
    assert [c.spec.name for c in caches] == ["fp16", "int8+hk", "int4"]
    assert caches[1].window == 512  # the others keep their layer's attention kind
    with pytest.raises(FormatError, match="outside"):
        parse_arm("int8:L5=fp16").check(num_layers=2)
    for bad in ("int8:0=fp16", "int8:Lx=fp16", "int8:L0=fp16:x"):
        with pytest.raises(FormatError, match="L<index>=<format>"):
            check_config(QualityConfig(contexts=[64], tail=8, kvs=[bad]))
    with pytest.raises(FormatError, match="'int8:L0=fp16:L8=int4'"):
        check_config(QualityConfig(contexts=[64], tail=8, kvs=["int8/L0:fp16/L8:int4"]))
    with pytest.raises(ValueError, match="unknown KV format"):
        check_config(QualityConfig(contexts=[64], tail=8, kvs=["int8:L0=int5"]))


def test_run_refuses_unknown_layers_before_any_cell(tmp_path, tiny) -> None:
    """A layer override past the model's last layer fails up front, not when its arm's
    first cell comes (after the other arms' passes) and before any run folder is made."""
    n = len(tiny.model.config.layer_windows())
    cfg = QualityConfig(model="tiny", contexts=[64], kvs=["int8", f"int8:L{n}=fp16"], tail=8)
    with pytest.raises(FormatError, match=f"outside 0..{n - 1}"):
        run_quality(cfg, tmp_path, model=tiny, log=lambda s: None)
    assert not any(tmp_path.iterdir())


def test_run_rows_resume_and_report(tmp_path, gemma) -> None:
    cfg = QualityConfig(model="tiny-gemma3", contexts=[96, 80], kvs=["int8", "int4+hk@s2r16"],
                        tail=16, chunk_size=40)
    run = run_quality(cfg, tmp_path, model=gemma, log=lambda s: None)
    rows = read_rows(run)
    assert [(r["kv"], r["context"]) for r in rows] == [
        ("fp16", 80), ("int8", 80), ("int4+hk@s2r16", 80),
        ("fp16", 96), ("int8", 96), ("int4+hk@s2r16", 96)]
    for r in rows:
        validate_row(r)
        assert r["status"] == "ok" and r["kind"] == "quality" and r["tokens_scored"] == 16
    base, int8 = rows[3], rows[4]
    assert base["kl"] == 0 and base["top1"] == 1 and base["layer_attn_rel_err"] is None
    assert 0 < int8["kl"] < rows[5]["kl"]
    assert int8["ppl_base"] == base["ppl"] and len(int8["layer_attn_rel_err"]) == 6
    assert int8["cache_bytes"] < base["cache_bytes"]
    assert int8["layer_specs"] == ["int8"] * len(int8["layer_windows"])  # what each stored
    env = json.loads((run / "env.json").read_text())  # which text and tokens were scored
    ids = text_ids(gemma.tokenizer, text_of(None), 97)
    assert env["text_tokens"] == 97
    assert env["token_ids_sha256"] == text_fingerprint(text_of(None), ids)["token_ids_sha256"]
    assert env["token_ids_sha256"] != text_fingerprint(text_of(None), ids[1:] + [0])[
        "token_ids_sha256"]
    # Killed mid-write of the last row: resume redoes that cell only.
    path = run / "rows.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][:20])
    run_quality(cfg, resume=run, model=gemma, log=lambda s: None)
    again = read_rows(run)
    assert len(again) == 6 and again[-1]["kv"] == "int4+hk@s2r16"
    assert again[-1]["kl"] == pytest.approx(rows[-1]["kl"], rel=1e-6)
    md = "\n".join(section_quality(again))
    assert "## Quality" in md and "int4+hk@s2r16" in md and "| 5 | global |" in md
    assert "int8" in quality_text_table(again)


def test_cli_runs_and_rejects_bad_input(tmp_path, capsys) -> None:
    assert cli_main(["quality", "--model", "tiny", "--contexts", "48", "--tail", "8",
                     "--kv", "int4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "int4" in out and "KL mean" in out
    (run,) = [p for p in Path(tmp_path).iterdir() if p.is_dir()]
    assert "## Quality" in (run / "report.md").read_text()
    assert cli_main(["quality", "--model", "tiny", "--contexts", "48", "--tail", "8",
                     "--kv", "int5", "--out", str(tmp_path)]) == 2
    assert "unknown KV format" in capsys.readouterr().err
    assert cli_main(["quality", "--model", "tiny", "--contexts", "4q",
                     "--out", str(tmp_path)]) == 2
    assert cli_main(["quality", "--model", "/no/such/model", "--contexts", "48", "--tail", "8",
                     "--out", str(tmp_path)]) == 2
    assert len([p for p in Path(tmp_path).iterdir() if p.is_dir()]) == 1, "no empty run folders"


def test_rows_name_q4s_sliding_layer_format(gemma) -> None:
    """q4 stores k4-c64v4-g128@r64i8 on sliding-window layers (SLIDING_FORMS): a quality row
    says which format each layer held, so its bytes and KL can be read against it. (This
    model's 64-token windows are all recent tokens, int8: no body to fit to head_dim 64.)"""
    cfg = QualityConfig(model="tiny-gemma3", contexts=[80], kvs=["q4"], tail=8, chunk_size=40)
    row, _ = measure(gemma.model, _ids(81), "q4", cfg, None)
    want = ["k4w-c64v4@s4r128" if w is None else "k4-c64v4-g128@r64i8"
            for w in row["layer_windows"]]
    assert row["layer_specs"] == want and len(set(want)) == 2


def test_sliding_kv_leaves_the_baseline_unquantized(gemma) -> None:
    """`--sliding-kv` gives the quantized arms' sliding layers a format; the fp16 baseline
    every KL is held to keeps all its layers fp16 (it once took the sliding format too, so
    KL measured only the global layers' error). q3's short name stores int3+hk@s4r16 there."""
    cfg = QualityConfig(model="tiny-gemma3", contexts=[80], kvs=["q3"], tail=8, chunk_size=40,
                        sliding_kv="int4+hk@s4r32")
    base, _ = measure(gemma.model, _ids(81), "fp16", cfg, None)
    assert set(base["layer_specs"]) == {"fp16"}
    row, _ = measure(gemma.model, _ids(81), "q3", cfg, torch.zeros(8, 1))
    want = ["k3-c64v3-g32@s4r96" if w is None else "int4+hk@s4r32" for w in row["layer_windows"]]
    assert row["layer_specs"] == want
    cfg.sliding_kv = None
    row, _ = measure(gemma.model, _ids(81), "q3", cfg, torch.zeros(8, 1))
    assert {s for s, w in zip(row["layer_specs"], row["layer_windows"]) if w} == {
        "int3+hk@s4r16"}
