"""Preallocated KVTaxCache decoding through device-side positions (the CUDA-graph route).

The route runs only where the fused kernels serve the call, because only they read each
row's length from the device (`lengths`) and ignore the host length, which the route pins
to a constant. On a CPU this test stands in for the kernels with a torch function that
keeps exactly that contract, and checks that decoding through device positions gives what
the host-length path gives, and that host and device bookkeeping agree afterwards. The
kernels' own handling of `lengths` is tested with the kernels (tests/attention/test_kernels_*.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvtax.attention import triton_api
from kvtax.attention.reference import attention_naive
from kvtax.cache.storage import ALIGN
from kvtax.hf import KVTaxCache, installed
from kvtax.hf.cache import cache_kwarg
from kvtax.hf.models import tiny_config
from kvtax.hf.positions import DevicePositions
from tests.support.tensors import assert_close

PROMPT, NEW = 11, 4


def _kernel_stand_in(q, view, *, scale=None, softcap=None, lengths=None, kv_start=None):
    """The kernels' contract: with device `lengths` the host `view.length` is ignored."""
    if lengths is not None:  # the route pins the host length to the capacity, which lies
        # in the last storage.ALIGN slots of the allocation (rounded up to a multiple)
        assert view.k.codes.shape[2] - ALIGN < view.length <= view.k.codes.shape[2]
        view = dataclasses.replace(view, length=int(lengths[0]), length_t=None)
    return attention_naive(q, view, scale=scale, softcap=softcap, kv_start=kv_start)


@pytest.fixture
def kernels_everywhere(monkeypatch):
    """Route every attention call to the (stand-in) kernels, CPU tensors included."""
    dispatch = importlib.import_module("kvtax.attention.dispatch")
    monkeypatch.setattr(dispatch, "kernel_unavailable", lambda *a, **k: None)
    monkeypatch.setattr(triton_api, "triton_attention", _kernel_stand_in)


def _generate(model, cache, ids, new=NEW, **kw):
    kw.setdefault("disable_compile", "compile_config" not in kw)
    with installed(model), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(
            ids, max_new_tokens=new, do_sample=False, pad_token_id=0, output_scores=True,
            return_dict_in_generate=True, **{cache_kwarg(model): cache}, **kw,
        )  # fmt: skip
    return out.sequences, torch.stack(out.scores, 1)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_device_position_decode_equals_host_length_decode(
    family: str, kernels_everywhere, monkeypatch
) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, window=6)).eval()
    ids = torch.randint(1, 97, (1, PROMPT))
    calls = []
    original = DevicePositions.decode

    def spy(self, *a, **k):
        calls.append(self)
        return original(self, *a, **k)

    monkeypatch.setattr(DevicePositions, "decode", spy)
    kw = dict(kv="int8", max_cache_len=PROMPT + NEW, prefill_chunk=4)
    host_seq, host_scores = _generate(
        model, KVTaxCache(model.config, graph_decode=False, **kw), ids
    )
    assert not calls
    cache = KVTaxCache(model.config, **kw)
    seq, scores = _generate(model, cache, ids)
    n_layers = model.config.num_hidden_layers
    assert len(calls) == (NEW - 1) * n_layers  # every decode step of every layer
    assert torch.equal(seq, host_seq)
    assert_close(scores, host_scores, atol=1e-5, rel_rms=1e-5, what=family)
    for layer in cache.layers:
        n = layer.cache.length
        assert n == PROMPT + NEW - 1 == layer.seen
        assert int(layer.positions.pos_t) == n and layer.positions.len_t.tolist() == [n]


def _capacity_attention(q, view, *, scale=None, softcap=None, lengths=None, kv_start=None):
    """A traceable stand-in for the kernels on a full cache: reads every slot up to the
    capacity and masks by the device `lengths`, so no host length enters the graph."""
    if lengths is None:
        return attention_naive(q, view, scale=scale, softcap=softcap, kv_start=kv_start)
    valid = torch.arange(view.k.codes.shape[2])[None, :] < lengths[:, None].long()  # [B, T]
    keep = valid[:, None, :, None]
    k = torch.where(keep, view.spec.key.dequantize(view.k), 0.0)  # unwritten slots: garbage
    v = torch.where(keep, view.spec.value.dequantize(view.v), 0.0)
    b, hq, n, d = q.shape
    qg = q.float().view(b, k.shape[1], hq // k.shape[1], n, d) * (scale or d**-0.5)
    s = torch.einsum("bhgld,bhtd->bhglt", qg, k).masked_fill(~valid[:, None, None, None], -1e30)
    return torch.einsum("bhglt,bhtd->bhgld", s.softmax(-1), v).flatten(1, 2).to(q.dtype)


@pytest.mark.slow
def test_compiled_decode_graphs_have_static_shapes(kernels_everywhere, monkeypatch) -> None:
    """transformers' compiled decode over a preallocated KVTaxCache traces to graphs with no
    symbolic-int input (what CUDA-graph capture needs), and generates what eager does."""
    from transformers import CompileConfig

    monkeypatch.setattr(triton_api, "triton_attention", _capacity_attention)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([type(x).__name__ for x in example_inputs if not isinstance(x, torch.Tensor)])
        return gm.forward

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    ids = torch.randint(1, 97, (1, PROMPT))
    kw = dict(kv="int8", max_cache_len=PROMPT + 8)
    eager_seq, eager_scores = _generate(model, KVTaxCache(model.config, **kw), ids, new=8)
    config = CompileConfig(backend=backend, mode="default", fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on CUDA only by default
    cache = KVTaxCache(model.config, **kw)
    seq, scores = _generate(model, cache, ids, new=8, compile_config=config)
    torch._dynamo.reset()
    assert graphs and all(not g for g in graphs), graphs  # no SymInt among the inputs
    assert len(graphs) == 1  # no recompile: the compiled step reads no host token count
    assert torch.equal(seq, eager_seq)
    assert_close(scores, eager_scores, atol=1e-5, rel_rms=1e-5, what="compiled")
    assert cache.get_seq_length() == PROMPT + 8 - 1  # eager reads bring the host count back


def test_static_cache_tensors_are_marked_static_and_counts_are_not_read_back(monkeypatch) -> None:
    """Every tensor a compiled decode step mutates or reads from a preallocated KVTaxCache
    (codes, scales, biases of every layer, the device counters) has a fixed address marked
    for CUDA graphs; while compiled steps run ahead of the host count, the sizes
    transformers asks for every step come without a device read (a GPU stall)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gemma3", window=6)).eval()
    cache = KVTaxCache(model.config, kv="int8", max_cache_len=PROMPT + NEW, prefill_chunk=4)
    with installed(model), torch.no_grad():
        model(torch.randint(1, 97, (1, PROMPT)), **{cache_kwarg(model): cache})
    for layer in cache.layers:
        store = layer.cache.store
        tensors = layer.positions.static_tensors()
        parts = [*store.k.parts(), *store.v.parts()]
        assert len(parts) == 6  # int8: codes, scales, biases for K and V
        assert all(any(t is p for t in tensors) for p in parts)
        for t in tensors:
            assert getattr(t, "_dynamo_static_input_type", None) is not None
        assert layer.positions.view.length == store.capacity  # the pinned decode view

    def no_read(self):
        raise AssertionError("a device count was read back")

    for layer in cache.layers:
        layer.positions.behind = True  # as after compiled decode steps
    monkeypatch.setattr(DevicePositions, "reconcile", no_read)
    for i, layer in enumerate(cache.layers):
        assert cache.get_seq_length(i).item() == PROMPT  # the device count, as a tensor
        assert cache.get_mask_sizes(1, i) == (layer.cache.capacity, 0)
