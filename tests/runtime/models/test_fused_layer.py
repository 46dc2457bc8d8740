"""The fused decoder layer (one q/k/v GEMM, one gate/up GEMM) against the unfused HF layer."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlkv.runtime.models import fused_layer
from vlkv.runtime.models.fused_layer import (
    SKINNY_MAX_ROWS,
    fusable,
    fused_forward,
    fused_weights,
    linear,
    mode_from_env,
)
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.prompt import Prompt

MODELS = ("tiny-llava", "tiny-qwen2-vl")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _layer_inputs(loaded, rows: int, q: int):
    """A layer, ``(rows, q, hidden)`` inputs and their rotary tables (positions 5.., M-RoPE for Qwen2-VL)."""
    from vlkv.runtime.torch_backend import TorchBackend

    be = TorchBackend(loaded.model, loaded.family, loaded.image_token_id)
    torch.manual_seed(0)
    hidden = torch.randn(rows, q, be.adapter.text_config.hidden_size)
    pos = (torch.arange(q) + 5).expand(rows, q)[..., None].expand(rows, q, be.pos_dims)
    return be.adapter, hidden, be.adapter.rotary(hidden, pos)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("rows,q", [(4, 1), (2, 1), (1, 1), (4, 6)])
@pytest.mark.parametrize("skinny", [False, True])
def test_fused_layer_equals_the_hf_layer(name, rows, q, skinny):
    loaded = load_model(name)
    adapter, hidden, cos_sin = _layer_inputs(loaded, rows=rows, q=q)
    for layer in adapter.layers:
        assert fusable(layer), type(layer).__name__
        want = layer(hidden, attention_mask=None, position_embeddings=cos_sin)
        got = fused_forward(layer, hidden, None, cos_sin, skinny=skinny)
        # same ops in the same order, but a wider GEMM may block its reduction differently and the
        # skinny form sums in another order: fp32 rounding only
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # after fusing, the HF layer reads the same storage and still gives its own result
        again = layer(hidden, attention_mask=None, position_embeddings=cos_sin)
        torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_fused_weights_are_views_of_the_hf_weights_and_carry_qwen2_biases():
    loaded = load_model("tiny-qwen2-vl")
    layer = loaded.model.model.language_model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    before = [
        t.clone() for t in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_proj.bias)
    ]
    fw = fused_weights(layer)
    assert fw.qkv_bias is not None  # Qwen2 has q/k/v biases
    assert attn.q_proj.weight.data_ptr() == fw.qkv.data_ptr()
    assert mlp.gate_proj.weight.data_ptr() == fw.gate_up.data_ptr()
    after = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_proj.bias)
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    assert fused_weights(layer) is fw  # built once
    # a module given a new weight (e.g. a dtype change) is fused again from it
    attn.q_proj.weight = torch.nn.Parameter(attn.q_proj.weight.detach() * 2)
    fresh = fused_weights(layer)
    assert fresh is not fw
    assert torch.equal(fresh.qkv[: fresh.splits[0]], before[0] * 2)


def test_fused_layer_makes_four_linear_calls_instead_of_seven():
    loaded = load_model("tiny-llava")
    adapter, hidden, cos_sin = _layer_inputs(loaded, rows=4, q=1)
    layer = adapter.layers[0]
    fused_weights(layer)  # built once, before the counted call
    with torch.no_grad(), _Count() as hf:
        layer(hidden, attention_mask=None, position_embeddings=cos_sin)
    with torch.no_grad(), _Count() as fused:
        fused_forward(layer, hidden, None, cos_sin)
    linear = ("addmm", "mm", "linear", "bmm")
    assert sum(hf.ops.get(k, 0) for k in linear) == 7
    assert sum(fused.ops.get(k, 0) for k in linear) == 4
    assert sum(fused.ops.values()) < sum(hf.ops.values())


@pytest.mark.parametrize("rows", [1, 2, 3, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    w, x = torch.randn(96, 40), torch.randn(rows, 1, 40)
    b = torch.randn(96) if bias else None
    want = torch.nn.functional.linear(x, w, b)
    got = linear(x, w, b, skinny=True)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if not 2 <= rows <= SKINNY_MAX_ROWS:  # outside its rows the skinny form is F.linear itself
        assert torch.equal(got, want)
    assert torch.equal(linear(x, w, b, skinny=False), want)


def test_the_switch(monkeypatch):
    for raw, mode in [("0", "hf"), ("off", "hf"), ("fused", "fused"), ("1", "skinny"), ("skinny", "skinny")]:
        monkeypatch.setenv("VLKV_FUSED_LAYER", raw)
        assert mode_from_env() == mode
    monkeypatch.delenv("VLKV_FUSED_LAYER")
    assert mode_from_env() == "skinny"
    monkeypatch.setenv("VLKV_FUSED_LAYER", "fast")
    with pytest.raises(ValueError, match="VLKV_FUSED_LAYER must be one of hf, fused, skinny"):
        mode_from_env()
    assert "MistralDecoderLayer" not in fused_layer.FUSABLE  # sliding-window kwargs: runs the HF layer


@pytest.mark.parametrize("name", MODELS)
def test_generation_with_and_without_fusing_gives_the_same_tokens(name, images):
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.policies import make_policy

    engine = Engine(load_model(name))
    prompts = [Prompt("Describe the picture.", [images[0]]), Prompt("Write a short poem about caches.")]
    engine.backend.adapter.fused = "hf"
    want = engine.generate(prompts, make_policy("full"), 8, stop_at_eos=False)
    for mode in ("fused", "skinny"):
        engine.backend.adapter.fused = mode
        got = engine.generate(prompts, make_policy("full"), 8, stop_at_eos=False)
        assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples], mode
    assert any(getattr(layer, "_vlkv_fused", None) is not None for layer in engine.backend.adapter.layers)


@pytest.mark.slow
@pytest.mark.demo
def test_smollm2_llava_skinny_layers_equal_transformers_generate():
    """The real-weight decoder (30 layers, fp32) in the default mode, batched 4 rows at decode (the
    skinny form's rows): every prompt's greedy tokens equal transformers' ``generate`` on its own."""
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.photos import real_photos
    from vlkv.runtime.policies import make_policy

    engine = Engine(load_model("smollm2-llava"))
    assert engine.backend.adapter.fused == "skinny"
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


@pytest.mark.parametrize("mode", ["hf", "fused", "skinny"])
def test_output_head_in_every_mode_equals_lm_head(mode):
    loaded = load_model("tiny-llava")
    adapter, _, _ = _layer_inputs(loaded, rows=1, q=1)
    adapter.fused = mode
    for rows in (1, 3, 8):
        hidden = torch.randn(rows, adapter.text_config.hidden_size)
        want = adapter.lm_head(hidden)
        torch.testing.assert_close(adapter.head(hidden, fused=True), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(adapter.head(hidden), want)  # not asked for (replay, prefill callers)
