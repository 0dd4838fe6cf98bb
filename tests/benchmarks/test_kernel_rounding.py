"""benchmarks/kernel_rounding.py: the same inputs every run, outputs saved and compared."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kernel_rounding  # noqa: E402


def test_runs_repeat_bit_for_bit_and_compare(tmp_path, capsys):
    args = ["--contexts", "200", "--kv", "k4-c64v4@s4r16", "--out", str(tmp_path)]
    assert kernel_rounding.main(args + ["--tag", "a"]) == 0
    assert kernel_rounding.main(args + ["--tag", "b", "--against", "a"]) == 0
    saved = torch.load(tmp_path / "a-200.pt")
    assert sorted(saved) == sorted(f"k4-c64v4@s4r16/{p}{r}" for p in ("prefill", "decode")
                                   for r in ("", "_ref"))
    assert saved["k4-c64v4@s4r16/prefill"].shape == (1, 14, 200, 64)  # the last chunk's rows
    assert saved["k4-c64v4@s4r16/decode"].shape == (1, 14, 1, 64)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " vs a rel " in ln]
    assert len(lines) == 4 and all(ln.endswith("rel 0.000e+00") for ln in lines)



def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    out = ["--out", str(tmp_path), "--tag", "a", "--contexts", "64"]
    assert kernel_rounding.main(out + ["--against", "never-saved"]) == 2
    assert kernel_rounding.main(out + ["--kv", "q5"]) == 2  # an unknown format
    assert kernel_rounding.main(["--out", str(tmp_path), "--tag", "a", "--contexts", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("kernel_rounding: ") for line in err)
    assert "never-saved-64.pt" in err[0] and "'q5'" in err[1]
