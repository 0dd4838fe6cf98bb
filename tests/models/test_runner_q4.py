"""The q4 short name through the Runner: chunked prefill and decode give the logits of one
whole prefill (q4's body reads only complete 64-token blocks), on full and sliding layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.models import Runner, load_model
from kvtax.models.config import get_config
from tests.support.tensors import assert_close


@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3"])
def test_q4_logits_do_not_depend_on_chunking(name) -> None:
    cfg = get_config(name)
    if cfg.sliding_window:  # a window past the 128 recent tokens: a c64 sliding body
        cfg = dataclasses.replace(cfg, sliding_window=300)
    model = load_model(cfg)
    ids = torch.randint(0, 256, (1, 420), generator=torch.Generator().manual_seed(0))
    logits = []
    for chunk in (420, 7, 130):
        runner = Runner(model, kv="q4", chunk_size=chunk)
        caches = runner.make_caches()
        assert caches[0].spec.name == "k4-c64v4@s4r128"
        out = [runner.prefill(ids[:, :400], caches)]
        out += [runner.decode_step(ids[:, t:t + 1], caches) for t in range(400, 420)]
        logits.append(torch.stack(out))
    assert torch.isfinite(logits[0]).all()
    for other in logits[1:]:
        # loose: the fp16 recent window's LSE merge alone moves these logits by ~2e-4 (as
        # with int4@s4r128); keys read from a stale or open block move them by ~7e-3
        assert_close(other, logits[0], atol=1e-3, rel_rms=1e-3, what="chunked prefill")
    fp16 = Runner(model, kv="fp16", chunk_size=420)
    caches = fp16.make_caches()
    ref = fp16.prefill(ids[:, :400], caches)
    gap = (logits[0][0] - ref).abs().max()
    assert 0 < gap < 1.0, "q4 differs from fp16 KV, a little"
