"""4-bit value error per layer, per-token groups of 64 with and without a Hadamard rotation
(what `+hv` stores), beside groups of 32, per channel over 64-token blocks and q4's keys.
Errors are MSE relative to each channel's variance over the tokens."""
import torch

from capture import forward
from kvtax.formats.rotation import rotate
from kvtax.formats.spec import parse_format


def rel(x: torch.Tensor, fmt: str, rotated: bool = False) -> float:
    y = rotate(x) if rotated else x
    f = parse_format(fmt)
    err = f.dequantize(f.quantize(y)) - y  # H is orthonormal: the same error unrotated
    return (err.pow(2).mean() / (x - x.mean(-2, keepdim=True)).pow(2).mean()).item()


def kurtosis(x: torch.Tensor) -> float:
    z = x - x.mean(-1, keepdim=True)
    return (z.pow(4).mean() / z.pow(2).mean() ** 2).item()


_, keys, values = forward()
print("layer | V int4 | V int4 rotated | V int4-g32 | V int4-c64 | K int4-c64 | "
      "V row kurtosis | rotated")
for i, (k, v) in enumerate(zip(keys, values)):
    row = (rel(v, "int4"), rel(v, "int4", True), rel(v, "int4-g32"), rel(v, "int4-c64"),
           rel(k, "int4-c64"), kurtosis(v), kurtosis(rotate(v)))
    print(i, *(f"{x:.3g}" for x in row), sep=" | ")
