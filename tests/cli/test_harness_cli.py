"""`kvtax capacity` and `kvtax roofline` on CPU, in-process."""

from __future__ import annotations

import json

from kvtax.cli import main
from kvtax.harness.schema import validate_row
from kvtax.harness.store import read_rows


def test_capacity_prints_tokens_per_format(capsys):
    assert main(["capacity", "--model", "llama-3.1-8b", "--reserve", "13.37GiB",
                 "--kv", "fp16,fp8,fp8-pt", "--device-memory", "141GiB"]) == 0
    out = capsys.readouterr().out
    assert "109,527" in out  # fp16: 13.37 GiB / 131,072 B per token
    assert "215,684" in out  # fp8: 66,560 B per token (scales included)
    assert "219,054" in out  # fp8-pt: 65,536 B per token (vLLM's fp8: 219,008 in blocks)
    rows = {line.split()[0]: line.split()[1:5] for line in out.splitlines()
            if line.split() and line.split()[0] in ("fp16", "fp8", "fp8-pt")}
    # bytes/token, codes, scales, biases
    assert rows["fp8"] == ["66,560", "65,536", "1,024", "0"]
    assert rows["fp8-pt"] == ["65,536", "65,536", "0", "0"]
    assert "1.97x" in out and "longest context" in out


def test_capacity_takes_the_short_names(capsys):
    """q4 / q3 (hybrid: fp16 sinks and recent tokens beside a quantized body) were refused
    with "drop the '@…'", which the user had not typed."""
    assert main(["capacity", "--model", "llama-3.1-8b", "--reserve", "13.37GiB",
                 "--kv", "fp16,int4,q4,q3"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()}
    # the body weighs int4's 36,864 B per token plus the key rows' fifth bits and channel
    # order (8 B a row: 72 code bytes at D 128); 132 fp16 tokens x 32 layers x 8 heads fixed
    assert rows["k4w-c64v4@s4r128"][:5] == ["38,912", "34,816", "2,048", "2,048", "16.50"]
    assert rows["k4w-c64v4@s4r128"][6] == "368,488"  # (budget - 16.5 MiB) / 38,912
    assert rows["int4"][4] == "-" and "k3-c64v3-g32@s4r96" in rows
    assert main(["capacity", "--reserve", "1GiB", "--kv", "q4@s4r8"]) == 2
    assert "write k4w-c64v4@s4r8" in capsys.readouterr().err


def test_capacity_needs_a_budget(capsys):
    assert main(["capacity", "--model", "tiny"]) == 2
    assert "--reserve" in capsys.readouterr().err


def test_roofline_writes_roofline_rows(tmp_path, capsys):
    assert main(["roofline", "--device", "cpu", "--model", "tiny", "--contexts", "128,256",
                 "--kv", "fp16,int4", "--iters", "2", "--stream-bytes", "8MiB",
                 "--out", str(tmp_path)]) == 0
    (run,) = list(tmp_path.iterdir())
    rows = read_rows(run)
    for r in rows:
        validate_row(r)
    ops = [r["op"] for r in rows]
    assert ops[:3] == ["stream", "stream", "matmul"]
    att = [r for r in rows if r["op"] == "attention"]
    # fp16: fused + fp16 (SDPA); int4: fused + unfused + dequant; at two contexts.
    assert len(att) == 2 * 5
    assert {r["arm"] for r in att} == {"fp16/fused", "fp16/fp16", "int4/fused", "int4/unfused",
                                       "int4/dequant"}
    for r in att:
        assert r["status"] == "ok" and r["time_s"] > 0
        assert 0 < r["bandwidth_fraction"] and r["compute_headroom"] > 0
        assert r["bytes_moved"] > 0 and r["flops"] == 4 * 4 * r["context"] * 64
    int4 = {r["context"]: r["bytes_moved"] for r in att if r["arm"] == "int4/fused"}
    fp16 = {r["context"]: r["bytes_moved"] for r in att if r["arm"] == "fp16/fused"}
    assert int4[256] < fp16[256] / 2
    assert json.loads((run / "config.json").read_text())["kind"] == "roofline"
    assert "GB/s" in capsys.readouterr().out


def test_roofline_times_q4_on_the_fused_path_only(tmp_path):
    """A short name that stands for a hybrid spec runs (it was refused as 'drop the @'),
    on the fused path only; its bytes are its body's plus its fp16 sinks and recent part."""
    assert main(["roofline", "--device", "cpu", "--model", "tiny", "--contexts", "256",
                 "--kv", "q4,int4", "--paths", "fused,unfused", "--iters", "2",
                 "--stream-bytes", "8MiB", "--out", str(tmp_path)]) == 0
    (run,) = list(tmp_path.iterdir())
    att = {r["arm"]: r for r in read_rows(run) if r["op"] == "attention"}
    assert set(att) == {"k4w-c64v4@s4r128/fused", "int4/fused", "int4/unfused"}
    q4, int4 = att["k4w-c64v4@s4r128/fused"], att["int4/fused"]
    assert q4["status"] == "ok" and q4["time_s"] > 0
    # tiny: 2 KV heads x 64, float32 metadata; 132 of the 256 tokens also held in fp16; each
    # key row 4 bytes over int4's (D/16: the fifth bits and the channel order)
    fp16_part = 2 * 132 * 2 * 64 * 2
    assert q4["bytes_moved"] == int4["bytes_moved"] + fp16_part + 256 * 2 * 4


def test_demo_shows_the_short_names(capsys):
    """The default demo includes q8 and q4 (q4: fp16 sinks and recent tokens around
    per-channel int4 keys); on its synthetic keys with outlier channels q4's attention error
    is under plain int4's, for fewer than fp16's bytes."""
    assert main(["demo", "--context", "512", "--heads", "4/2", "--head-dim", "64"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
            if line.split()}
    assert {"int8+hk+ck", "k4w-c64v4@s4r128", "int4"} <= set(rows)
    assert float(rows["k4w-c64v4@s4r128"][-1]) < float(rows["int4"][-1])
