"""A model's fp32 CPU weights moved into one huge-page buffer (``vlkv/plugins/weight_pages.py``).

What must hold: the same ``Parameter`` objects hold the same values afterwards (a layer's output is
bit-equal), each moved weight is a contiguous slice of one 2 MiB-aligned buffer (64-byte aligned), tied
weights move once, small / non-fp32 weights stay, ``restore`` points back (and forth); without the
extension nothing moves.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from vlkv.plugins import decode_layer, weight_pages
from vlkv.runtime.models.skinny_layer import layer_forward


@pytest.fixture(autouse=True)
def _built():
    if weight_pages.kernel() is None:  # a C++ compiler is part of the CPU test environment
        pytest.fail("the huge-page buffer could not be built here")


def _layer():
    cfg = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaDecoderLayer(cfg, layer_idx=0).eval(), LlamaRotaryEmbedding(cfg)


def test_moved_weights_are_the_same_parameters_with_the_same_values():
    layer, rotary = _layer()
    hidden = torch.randn(4, 1, 576)
    cos_sin = rotary(hidden, torch.full((4, 1), 9))
    with torch.no_grad():
        want = layer_forward(layer, hidden, None, cos_sin)
    params = dict(layer.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    moved = weight_pages.move([layer])
    assert dict(layer.named_parameters()) == params  # the same Parameter objects
    big = {n for n, p in params.items() if p.numel() >= weight_pages.MIN_ELEMENTS}
    assert {id(p) for p in moved.params} == {id(params[n]) for n in big}
    assert "input_layernorm.weight" not in big  # 576 floats: stays
    base = moved.buffer.data_ptr()
    assert base % (2 << 20) == 0
    for n, p in params.items():
        assert torch.equal(p, values[n])
        inside = base <= p.data_ptr() < base + moved.buffer.numel() * 4
        assert inside is (n in big), n
        if n in big:
            assert p.is_contiguous() and p.data_ptr() % 64 == 0
    assert moved.bytes == sum(params[n].numel() * 4 for n in big)
    with torch.no_grad():
        assert torch.equal(layer_forward(layer, hidden, None, cos_sin), want)
    weight_pages.restore(moved)
    assert all(not (base <= p.data_ptr() < base + moved.buffer.numel() * 4) for p in params.values())
    weight_pages.restore(moved, huge=True)
    assert all(p.data_ptr() == s.data_ptr() for p, s in zip(moved.params, moved.slots))
    with torch.no_grad():
        assert torch.equal(layer_forward(layer, hidden, None, cos_sin), want)


def test_tied_weights_move_once_and_others_stay():
    emb = torch.nn.Embedding(1000, 64)
    head = torch.nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight  # tied, as small LMs' output heads are
    half = torch.nn.Linear(256, 256).half()
    moved = weight_pages.move([emb, head, half])
    assert len(moved.params) == 1 and head.weight is emb.weight
    assert head.weight.data_ptr() == moved.buffer.data_ptr()
    assert half.weight.dtype == torch.float16 and moved.bytes == 1000 * 64 * 4


def test_nothing_moves_without_the_extension(monkeypatch):
    monkeypatch.setattr(weight_pages, "_BUILT", [None])
    layer, _ = _layer()
    ptrs = [p.data_ptr() for p in layer.parameters()]
    moved = weight_pages.move([layer])
    assert moved.params == [] and moved.buffer is None
    assert [p.data_ptr() for p in layer.parameters()] == ptrs


def test_moving_needs_no_fused_decode_layer(monkeypatch):
    """The buffer is this module's own extension: with the fused layer off (``VLKV_CPU_LAYER=0``) or not
    buildable, the weights still move, and nothing asks for the decode layer's build."""

    def no_layer():
        raise AssertionError("weight_pages asked for the decode layer's extension")

    monkeypatch.setattr(decode_layer, "kernel", no_layer)
    monkeypatch.setattr(decode_layer, "FUSED_LAYER", False)
    layer, _ = _layer()
    moved = weight_pages.move([layer])
    assert moved.buffer is not None and len(moved.params) == 7  # q/k/v/o, gate/up/down
    weight_pages.restore(moved)
    assert "decode_layer" not in vars(weight_pages)  # not even imported


def test_place_lists_the_movable_parameters_once(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(weight_pages, "HUGE_WEIGHTS", True)
    layer, _ = _layer()
    adapter = SimpleNamespace(
        layers=torch.nn.ModuleList([layer]), norm=torch.nn.Identity(), lm_head=torch.nn.Linear(576, 300)
    )
    real, calls = weight_pages._movable_params, []
    monkeypatch.setattr(weight_pages, "_movable_params", lambda mods: (calls.append(1), real(mods))[1])
    moved = weight_pages.place(adapter, "cpu", torch.float32)
    assert calls == [1] and len(moved.params) == 8  # the layer's 7 projections and the head


def test_moved_checks_its_lists():
    with pytest.raises(ValueError, match="params, before and slots differ in length: 1, 0, 0"):
        weight_pages.Moved([torch.nn.Parameter(torch.zeros(1))], [], [])


def test_place_takes_cpu_fp32_models_and_the_switch(monkeypatch):
    """``place`` at engine start: a CPU fp32 model's decoder layers, final norm and output head (the
    tiny model's embedding, tied or not, is not asked for); another device or dtype, or the switch off:
    nothing moves."""
    from vlkv.runtime.models.registry import load_model
    from vlkv.runtime.torch_backend import TorchBackend

    loaded = load_model("tiny-llava")
    ad = TorchBackend(loaded.model, loaded.family, loaded.image_token_id).adapter
    monkeypatch.setattr(weight_pages, "HUGE_WEIGHTS", False)
    assert weight_pages.place(ad, "cpu", torch.float32).params == []
    monkeypatch.setattr(weight_pages, "HUGE_WEIGHTS", True)
    assert weight_pages.place(ad, "cpu", torch.bfloat16).params == []
    assert weight_pages.place(ad, "meta", torch.float32).params == []
    head = ad.lm_head.weight
    moved = weight_pages.place(ad, "cpu", torch.float32)
    assert any(p is head for p in moved.params)
    want = {
        id(p)
        for m in (ad.layers, ad.norm, ad.lm_head)
        for p in m.parameters()
        if p.numel() >= weight_pages.MIN_ELEMENTS
    }
    assert {id(p) for p in moved.params} == want


def test_place_moves_an_engines_weights_once_and_for_good(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(weight_pages, "HUGE_WEIGHTS", True)
    layer, _ = _layer()
    adapter = SimpleNamespace(
        layers=torch.nn.ModuleList([layer]), norm=torch.nn.Identity(), lm_head=torch.nn.Linear(576, 300)
    )
    weights = [adapter.layers[0].mlp.up_proj.weight, adapter.lm_head.weight]
    values = [w.detach().clone() for w in weights]
    moved = weight_pages.place(adapter, "cpu", torch.float32)
    assert moved.params and not moved.before  # the checkpoint's tensors are let go
    buffer = moved.buffer.data_ptr()
    for w, v in zip(weights, values):
        assert buffer <= w.data_ptr() < buffer + moved.buffer.numel() * 4 and torch.equal(w, v)
    # a second engine over the same model: nothing copied again
    assert weight_pages.place(adapter, "cpu", torch.float32) is moved
    with pytest.raises(ValueError, match="placed for good"):
        weight_pages.restore(moved)
    # weights replaced since (a reload into the same modules): they move again
    with torch.no_grad():
        adapter.lm_head.weight.data = adapter.lm_head.weight.data.clone()
    again = weight_pages.place(adapter, "cpu", torch.float32)
    assert again is not moved and adapter.lm_head.weight.data_ptr() >= again.buffer.data_ptr()
    # other devices, dtypes or the switch off: nothing moves
    assert not weight_pages.place(adapter, "cpu", torch.float16).params
    monkeypatch.setattr(weight_pages, "HUGE_WEIGHTS", False)
    assert not weight_pages.place(SimpleNamespace(layers=torch.nn.ModuleList()), "cpu", torch.float32).params


def test_place_leaves_a_model_that_would_not_fit_twice(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(weight_pages, "HUGE_WEIGHTS", True)
    head = torch.nn.Linear(576, 300)
    adapter = SimpleNamespace(layers=torch.nn.ModuleList(), norm=torch.nn.Identity(), lm_head=head)
    before = head.weight.data_ptr()
    need = head.weight.numel() * 4
    monkeypatch.setattr(weight_pages, "available_bytes", lambda: 2 * need - 1)
    with pytest.warns(UserWarning, match="left out of huge pages"):
        assert not weight_pages.place(adapter, "cpu", torch.float32).params
    assert head.weight.data_ptr() == before
    monkeypatch.setattr(weight_pages, "available_bytes", lambda: 2 * need)
    assert weight_pages.place(adapter, "cpu", torch.float32).params == [head.weight]
    assert weight_pages.available_bytes() is None or weight_pages.available_bytes() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64], ids=str)
def test_zeros_gives_any_dtype_in_its_own_huge_page_advised_mapping_unmapped_with_the_tensor(dtype):
    from vlkv.runtime.kv import pool_memory

    shape = (3, 5000, 64)  # not a whole number of huge pages: a 4 KiB tail
    t = weight_pages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
    assert t.data_ptr() % (2 << 20) == 0
    t[1, 4999, 63] = 7  # writable, to its last element
    assert int(t.sum()) == 7
    assert pool_memory.huge_advised(t) is True
    at = t.data_ptr()
    del t  # the deleter unmaps it: no mapping holds its address any more (nothing else was mapped since)
    assert not any(lo <= at < hi for lo, hi, _ in pool_memory.mappings())
    assert weight_pages.zeros((0, 64), dtype).shape == (0, 64)
