"""The skinny-GEMM decoder layer (few-row GEMMs by the C++ GEMM or as ``(W @ xᵀ)ᵀ``) against the HF layer.

Every test runs twice: with the C++ GEMM (``skinny_gemm``, the default where it builds) and with it off
(``VLKV_CPU_GEMM=0``: torch's ``(W @ xᵀ)ᵀ`` for 2-4 rows, ``F.linear`` otherwise)."""

from __future__ import annotations

import pytest
import torch

from vlkv.plugins import layer_glue, skinny_gemm
from vlkv.runtime.models import skinny_layer
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.models.skinny_layer import (
    SKINNY_LAYERS,
    SKINNY_MAX_ROWS,
    layer_forward,
    linear,
    skinny_from_env,
)
from vlkv.runtime.prompt import Prompt

MODELS = ("tiny-llava", "tiny-qwen2-vl")
# fp32 rounding only: the skinny form sums each dot product in another order than F.linear
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True, params=[True, False], ids=["cpp", "torch"])
def cpp(request, monkeypatch):
    """The tiny models' weights are below ``SKINNY_MIN_WEIGHT``: take the skinny form for them too; the
    C++ GEMM on (it must build here) or off."""
    monkeypatch.setattr(skinny_layer, "SKINNY_MIN_WEIGHT", 0)
    monkeypatch.setattr(skinny_gemm, "CPP_GEMM", request.param)
    if request.param and (skinny_gemm.kernel() is None or layer_glue.kernel() is None):
        pytest.fail("the skinny GEMM or the layer glue could not be built here")
    return request.param


def _hf_products(rows: int, cpp: bool) -> bool:
    """Whether ``linear`` over ``rows`` rows runs ``F.linear`` itself (bit-equal to the HF layer)."""
    if cpp and 1 <= rows <= skinny_gemm.MAX_ROWS:
        return False
    return not 2 <= rows <= SKINNY_MAX_ROWS


def _layer_inputs(loaded, rows: int, q: int):
    """The adapter, ``(rows, q, hidden)`` inputs and their rotary tables (positions 5.., M-RoPE for Qwen2-VL)."""
    from vlkv.runtime.torch_backend import TorchBackend

    be = TorchBackend(loaded.model, loaded.family, loaded.image_token_id)
    torch.manual_seed(0)
    hidden = torch.randn(rows, q, be.adapter.text_config.hidden_size)
    pos = (torch.arange(q) + 5).expand(rows, q)[..., None].expand(rows, q, be.pos_dims)
    return be.adapter, hidden, be.adapter.rotary(hidden, pos)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("rows,q", [(4, 1), (2, 1), (1, 1), (4, 6)])
def test_skinny_layer_equals_the_hf_layer(name, rows, q, cpp):
    loaded = load_model(name)
    adapter, hidden, cos_sin = _layer_inputs(loaded, rows=rows, q=q)
    for layer in adapter.layers:
        want = layer(hidden, attention_mask=None, position_embeddings=cos_sin)
        got = layer_forward(layer, hidden, None, cos_sin)
        torch.testing.assert_close(got, want, **TOL)
        # outside its rows: the HF layer's own products (with the C++ kernels, its norms and RoPE are
        # C++ up to layer_glue.MAX_ROWS rows)
        if _hf_products(rows * q, cpp) and not (cpp and rows * q <= layer_glue.MAX_ROWS):
            assert torch.equal(got, want)


def test_qwen2_vl_biases_are_applied():
    loaded = load_model("tiny-qwen2-vl")
    adapter, hidden, cos_sin = _layer_inputs(loaded, rows=4, q=1)
    layer = adapter.layers[0]
    assert layer.self_attn.q_proj.bias is not None  # Qwen2 has q/k/v biases
    want = layer(hidden, attention_mask=None, position_embeddings=cos_sin)
    torch.testing.assert_close(layer_forward(layer, hidden, None, cos_sin), want, **TOL)
    with torch.no_grad():
        layer.self_attn.v_proj.bias += 1.0  # the skinny path reads the module's bias, not a copy
    moved = layer(hidden, attention_mask=None, position_embeddings=cos_sin)
    assert not torch.allclose(moved, want)
    torch.testing.assert_close(layer_forward(layer, hidden, None, cos_sin), moved, **TOL)


@pytest.mark.parametrize("rows", [1, 2, 3, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 7, 8, 9, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transposed_input", [False, True])
def test_skinny_linear_equals_f_linear(rows, bias, transposed_input, cpp):
    torch.manual_seed(rows)
    w, x = torch.randn(96, 40), torch.randn(rows, 1, 40)
    if transposed_input:  # an elementwise product of transposed outputs: not row-major
        x = torch.randn(40, rows).t().reshape(rows, 1, 40)
    b = torch.randn(96) if bias else None
    want = torch.nn.functional.linear(x, w, b)
    got = linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL)
    if _hf_products(rows, cpp):  # outside its rows the skinny form is F.linear itself
        assert torch.equal(got, want)


def test_small_weights_keep_f_linear(monkeypatch):
    monkeypatch.setattr(skinny_layer, "SKINNY_MIN_WEIGHT", 96 * 40 + 1)
    w, x = torch.randn(96, 40), torch.randn(4, 1, 40)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


def test_small_layers_keep_the_hf_ops_bit_for_bit(monkeypatch):
    """Below the weight floor a layer's GEMMs, norms and RoPE are the HF layer's own ops (the tiny test
    models' exactness tests see no C++ rounding)."""
    monkeypatch.setattr(skinny_layer, "SKINNY_MIN_WEIGHT", 1 << 30)
    loaded = load_model("tiny-llava")
    adapter, hidden, cos_sin = _layer_inputs(loaded, rows=4, q=1)
    for layer in adapter.layers:
        want = layer(hidden, attention_mask=None, position_embeddings=cos_sin)
        assert torch.equal(layer_forward(layer, hidden, None, cos_sin), want)


def test_the_switch(monkeypatch):
    for raw, on in [("0", False), ("off", False), ("1", True), ("on", True)]:
        monkeypatch.setenv("VLKV_SKINNY_GEMM", raw)
        assert skinny_from_env() is on
    monkeypatch.delenv("VLKV_SKINNY_GEMM")
    assert skinny_from_env()
    monkeypatch.setenv("VLKV_SKINNY_GEMM", "fast")
    with pytest.raises(ValueError, match="VLKV_SKINNY_GEMM must be 0 or 1, got 'fast'"):
        skinny_from_env()
    assert "MistralDecoderLayer" not in SKINNY_LAYERS  # sliding-window kwargs: runs the HF layer


@pytest.mark.parametrize("skinny", [False, True])
def test_output_head_equals_lm_head(skinny, cpp):
    loaded = load_model("tiny-llava")
    adapter, _, _ = _layer_inputs(loaded, rows=1, q=1)
    adapter.skinny = skinny
    for rows in (1, 3, 8):
        hidden = torch.randn(rows, adapter.text_config.hidden_size)
        want = adapter.lm_head(hidden)
        torch.testing.assert_close(adapter.head(hidden, fast=True), want, **TOL)
        assert torch.equal(adapter.head(hidden), want)  # not asked for: the module itself


@pytest.mark.parametrize("name", MODELS)
def test_generation_with_and_without_skinny_gemms_gives_the_same_tokens(name, images, cpp, monkeypatch):
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.policies import make_policy

    engine = Engine(load_model(name))
    prompts = [Prompt("Describe the picture.", [images[0]]), Prompt("Write a short poem about caches.")]
    engine.backend.adapter.skinny = False
    want = engine.generate(prompts, make_policy("full"), 8, stop_at_eos=False)
    engine.backend.adapter.skinny = True
    calls = []
    real = torch.mm
    torch.mm = lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1]
    gemm_calls = []
    real_linear = skinny_gemm.linear
    monkeypatch.setattr(skinny_gemm, "linear", lambda *a: (gemm_calls.append(1), real_linear(*a))[1])
    try:
        got = engine.generate(prompts, make_policy("full"), 8, stop_at_eos=False)
    finally:
        torch.mm = real
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]
    # the decode steps (2 rows) took the skinny form: the C++ GEMM, or (W @ xᵀ)ᵀ without it
    assert (gemm_calls and not calls) if cpp else (calls and not gemm_calls)


@pytest.mark.slow
@pytest.mark.demo
def test_smollm2_llava_skinny_layers_equal_transformers_generate():
    """The real-weight decoder (30 layers, fp32) with skinny GEMMs (the default), batched 4 rows at
    decode: every prompt's greedy tokens equal transformers' ``generate`` on its own."""
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.photos import real_photos
    from vlkv.runtime.policies import make_policy

    engine = Engine(load_model("smollm2-llava"))
    assert engine.backend.adapter.skinny
    ref = load_model("smollm2-llava")
    photos = real_photos()
    prompts = [
        Prompt("Describe this picture.", [photos[0]]),
        Prompt("The capital of France is"),
        Prompt("What is in the image? Answer in one sentence.", [photos[1]]),
        Prompt("Write one sentence about lighthouses."),
    ]
    new = 8
    got = engine.generate(prompts, make_policy("full"), new, stop_at_eos=False)
    for prompt, sample in zip(prompts, got.samples):
        text = ref.prompt_template(prompt.text, len(prompt.images))
        kwargs = {"text": [text], "return_tensors": "pt"}
        if prompt.images:
            kwargs["images"] = prompt.images
        inputs = ref.processor(**kwargs)
        out = ref.model.generate(
            **inputs, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert sample.token_ids == out[0, inputs["input_ids"].shape[1] :].tolist(), prompt.text
