"""llama.cpp's KV cache settings as kvtax arms, and what llama.cpp's log says about them.

Pure Python (no llama_cpp import), so the parent process can plan and check arms:

- `parse_kv("q8_0")` → ("q8_0", "q8_0"); `parse_kv("q8_0:q4_0")` → K q8_0, V q4_0 (as
  llama-bench's `-ctk q8_0 -ctv q4_0`).
- `row_bytes(type, n)`: bytes of one row of `n` elements in a ggml type (block layout).
- `LogWatch`: lines from llama.cpp's log callback → which flash-attention setting really
  ran, and the KV cache size llama.cpp allocated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvtax.errors import KVTaxError

# ggml type -> (enum ggml_type id, bytes per block, elements per block), from ggml.h and
# its block structs (block_q8_0: fp16 scale + 32 int8; block_q4_1: fp16 scale + fp16 min
# + 16 bytes...). The ids are ggml's ABI; llama_cpp does not export GGML_TYPE_BF16.
CACHE_TYPES: dict[str, tuple[int, int, int]] = {
    "f32": (0, 4, 1),
    "f16": (1, 2, 1),
    "bf16": (30, 2, 1),
    "q8_0": (8, 34, 32),
    "q4_0": (2, 18, 32),
    "q4_1": (3, 20, 32),
    "q5_0": (6, 22, 32),
    "q5_1": (7, 24, 32),
    "iq4_nl": (20, 18, 32),
}
UNQUANTIZED = ("f32", "f16", "bf16")

# path -> llama.cpp's flash_attn_type (LLAMA_FLASH_ATTN_TYPE_*: enabled 1, disabled 0,
# auto -1: llama.cpp decides at context creation, and may turn it off).
PATHS: dict[str, int] = {"fa": 1, "nofa": 0, "auto": -1}


def parse_kv(kv: str) -> tuple[str, str]:
    """An arm's kv name → (K type, V type); raises KVTaxError (one line) for a bad name."""
    k, sep, v = kv.partition(":")
    v = v if sep else k
    for t in (k, v):
        if t not in CACHE_TYPES:
            raise KVTaxError(f"llama.cpp cache type {t!r} (in kv {kv!r}) is not one of "
                             f"{', '.join(CACHE_TYPES)}; K:V as 'q8_0:q4_0'")
    return k, v


def check_path(path: str) -> None:
    if path not in PATHS:
        raise KVTaxError(f"llama.cpp path {path!r} is not one of {', '.join(PATHS)} "
                         f"(flash attention on, off, or llama.cpp's choice)")


def needs_fa(kv: str) -> bool:
    """llama.cpp refuses a quantized V cache without flash attention."""
    return parse_kv(kv)[1] not in UNQUANTIZED


def row_bytes(ggml_type: str, n: int) -> int:
    """Bytes of `n` elements of `ggml_type` (n a multiple of its block size)."""
    _, per_block, block = CACHE_TYPES[ggml_type]
    if n % block:
        raise KVTaxError(f"head dim {n} is not a multiple of {ggml_type}'s block of {block}")
    return n // block * per_block


def bytes_per_token(kv: str, n_layer: int, n_head_kv: int, head_k: int,
                    head_v: int) -> int:
    """KV bytes one token adds across all layers: layers x KV heads x (K row + V row)."""
    k, v = parse_kv(kv)
    return n_layer * n_head_kv * (row_bytes(k, head_k) + row_bytes(v, head_v))


# "llama_kv_cache: size =   22.50 MiB (  1024 cells,  30 layers,  1/1 seqs),
#  K (q8_0):   11.25 MiB, V (q8_0):   11.25 MiB"
_KV_SIZE = re.compile(r"size\s*=\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers.*?"
                      r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB")
# Lines where llama.cpp settles flash attention (llama-context.cpp), -> the state after.
_FA_LINES = (
    (re.compile(r"Flash Attention not supported, set to disabled"), False),
    (re.compile(r"Flash Attention enabled"), True),
    (re.compile(r"enabling flash_attn since it is required"), True),
    (re.compile(r"disabling flash attention"), False),
    (re.compile(r"flash_attn is not compatible .* forcing off"), False),
)
_FA_ASKED = re.compile(r"flash_attn\s*=\s*(enabled|disabled|auto)")
_MIB = 1024 * 1024


@dataclass
class LogWatch:
    """Collects llama.cpp's log lines and reads facts off them. Levels are ggml's
    (ggml.h): 1 debug (dropped), 2 info, 3 warn, 4 error, 5 continues the last line."""

    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    _kept: bool = False

    def add(self, level: int, text: str) -> None:
        """One callback call."""
        if level == 5:
            if self._kept and self.lines:
                self.lines[-1] += text
            return
        self._kept = level != 1
        if not self._kept:
            return
        self.lines.append(text)
        if level in (3, 4):
            self.warnings.append(text.strip())

    def flash_attn(self) -> bool | None:
        """Whether flash attention ran: the setting the context logged it was created
        with, then the last line where llama.cpp settled "auto" or overrode it; None
        when the log never said."""
        state = {"enabled": True, "disabled": False}.get(self.flash_attn_asked() or "")
        for line in self.lines:
            for pattern, after in _FA_LINES:
                if pattern.search(line):
                    state = after
        return state

    def flash_attn_asked(self) -> str | None:
        """The flash_attn setting llama.cpp says the context was created with."""
        for line in self.lines:
            m = _FA_ASKED.search(line)
            if m:
                return m.group(1)
        return None

    def kv_cache(self) -> dict | None:
        """The KV cache llama.cpp allocated: bytes (from its MiB, 2 decimals), cells,
        layers, K / V types; None if it never logged one."""
        for line in reversed(self.lines):
            m = _KV_SIZE.search(line)
            if m:
                return {"bytes": round(float(m.group(1)) * _MIB), "cells": int(m.group(2)),
                        "layers": int(m.group(3)), "type_k": m.group(4),
                        "type_v": m.group(6), "k_bytes": round(float(m.group(5)) * _MIB),
                        "v_bytes": round(float(m.group(7)) * _MIB)}
        return None

    def errors(self) -> str:
        """The last few error/warning lines, joined for an exception message."""
        return " | ".join(self.warnings[-3:])
