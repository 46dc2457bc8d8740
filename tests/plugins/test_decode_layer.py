"""A decode layer's work outside attention as two C++ calls (``vlkv/plugins/decode_layer.py``).

What must hold: ``pre`` (input RMSNorm → q/k/v GEMMs + biases → RoPE) equals the HF layer's own ops and
gives the layouts its transposes give; ``post`` (o GEMM + residual → RMSNorm → SiLU(gate)·up → down +
residual) equals the HF layer's; the skinny layer with them equals the skinny layer without them
(``VLKV_CPU_LAYER=0``, the reference path) — Llama with and without biases, Qwen2-VL (q/k/v biases,
M-RoPE), 1-4 and 8 rows —; what they cannot take runs the reference path (``fits`` False or the C++
side's refusal), and a failed build leaves the reference path with one warning.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tests.conftest import switch_values
from vlkv.plugins import decode_layer, layer_glue, paged_cpu_kernel, skinny_gemm
from vlkv.runtime.models import skinny_layer
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.models.skinny_layer import layer_forward

# fp32 rounding: the C++ GEMMs and norms sum in another order than the HF modules (against the skinny
# layer's separate calls — the same kernels — the results are bit-equal on the VM that measured it)
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _on(monkeypatch):
    """The C++ pieces on and built (a compiler is part of the CPU test environment); the tiny layers'
    weights are below the skinny layer's floor, so it is lowered for them."""
    monkeypatch.setattr(skinny_gemm, "CPP_GEMM", True)
    monkeypatch.setattr(decode_layer, "FUSED_LAYER", True)
    monkeypatch.setattr(skinny_layer, "SKINNY_MIN_WEIGHT", 0)
    if decode_layer.kernel() is None or skinny_gemm.kernel() is None or layer_glue.kernel() is None:
        pytest.fail("the decode layer could not be built here")


def _llama(bias: bool, seed: int = 0):
    """A Llama decoder layer (GQA 4/2 heads, head size 32) with random weights, its rotary module."""
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=320,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        attention_bias=bias,
        mlp_bias=bias,
        rms_norm_eps=1e-5,
    )
    cfg._attn_implementation = "sdpa"  # a standalone layer: no model set it
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    return layer, LlamaRotaryEmbedding(cfg)


def _llama_inputs(layer, rotary, rows: int, q: int):
    torch.manual_seed(rows * 10 + q)
    hidden = torch.randn(rows, q, 128)
    pos = (torch.arange(q) + 7 + torch.arange(rows)[:, None] * 3).long()
    return hidden, rotary(hidden, pos)


def _qwen2_vl_inputs(rows: int, q: int):
    """tiny-qwen2-vl's layers and inputs with M-RoPE positions whose t/h/w sections differ."""
    from vlkv.runtime.torch_backend import TorchBackend

    loaded = load_model("tiny-qwen2-vl")
    be = TorchBackend(loaded.model, loaded.family, loaded.image_token_id)
    torch.manual_seed(rows * 10 + q)
    hidden = torch.randn(rows, q, be.adapter.text_config.hidden_size)
    base = (torch.arange(q) + 5).expand(rows, q)
    pos = torch.stack([base, base + 2, base * 3], dim=-1)  # (rows, q, 3): t, h, w
    return be.adapter.layers, hidden, be.adapter.rotary(hidden, pos)


def _hf_pre(layer, hidden, cos, sin):
    attn = layer.self_attn
    shape, hd = hidden.shape[:-1], attn.head_dim
    h = layer.input_layernorm(hidden)
    q = attn.q_proj(h).view(*shape, -1, hd).transpose(1, 2)
    k = attn.k_proj(h).view(*shape, -1, hd).transpose(1, 2)
    v = attn.v_proj(h).view(*shape, -1, hd).transpose(1, 2)
    q, k = skinny_layer._rotary(attn)(q, k, cos, sin)
    return q, k, v


def _hf_post(layer, out, residual):
    hidden = residual + layer.self_attn.o_proj(out.reshape(*residual.shape[:-1], -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _check_pre_post(layer, hidden, cos_sin):
    cos, sin = cos_sin
    assert decode_layer.fits(layer, hidden, cos)
    got = decode_layer.pre(layer, hidden, cos, sin)
    want = _hf_pre(layer, hidden, cos, sin)
    assert got is not None
    for g, w in zip(got, want):
        # (B, H, S, D) views of row-major (B, S, H, D) buffers, as the skinny layer's transposes give
        assert g.shape == w.shape and g.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(g, w, **TOL)
    b, s, _ = hidden.shape
    heads = layer.self_attn.config.num_attention_heads
    torch.manual_seed(1)
    out = torch.randn(b, heads, s, layer.self_attn.head_dim).transpose(1, 2)  # an attention output: strided
    nxt = decode_layer.post(layer, out, hidden)
    assert nxt is not None and nxt.shape == hidden.shape and nxt.is_contiguous()
    torch.testing.assert_close(nxt, _hf_post(layer, out, hidden), **TOL)


def _on_and_off(layer, hidden, cos_sin, monkeypatch):
    """``layer_forward`` with the fused calls and without them (the reference), counting the calls."""
    calls = []
    real_pre, real_post = decode_layer.pre, decode_layer.post
    monkeypatch.setattr(decode_layer, "pre", lambda *a: (calls.append("pre"), real_pre(*a))[1])
    monkeypatch.setattr(decode_layer, "post", lambda *a: (calls.append("post"), real_post(*a))[1])
    got = layer_forward(layer, hidden, None, cos_sin)
    monkeypatch.setattr(decode_layer, "FUSED_LAYER", False)
    want = layer_forward(layer, hidden, None, cos_sin)
    monkeypatch.setattr(decode_layer, "FUSED_LAYER", True)
    return got, want, calls


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows,q", [(1, 1), (2, 1), (3, 1), (4, 1), (8, 1), (2, 3)])
def test_llama_pre_and_post_equal_the_hf_layer(bias, rows, q, monkeypatch):
    layer, rotary = _llama(bias)
    assert (layer.self_attn.q_proj.bias is not None) is bias and (
        layer.mlp.down_proj.bias is not None
    ) is bias
    hidden, cos_sin = _llama_inputs(layer, rotary, rows, q)
    with torch.no_grad():
        _check_pre_post(layer, hidden, cos_sin)
        got, want, calls = _on_and_off(layer, hidden, cos_sin, monkeypatch)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(
            got, layer(hidden, attention_mask=None, position_embeddings=cos_sin), **TOL
        )
    assert calls == ["pre", "post"]


@pytest.mark.parametrize("rows,q", [(1, 1), (2, 1), (4, 1), (1, 4)])
def test_qwen2_vl_pre_and_post_equal_the_hf_layer(rows, q, monkeypatch):
    layers, hidden, cos_sin = _qwen2_vl_inputs(rows, q)
    assert layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v biases
    with torch.no_grad():
        for layer in layers:
            _check_pre_post(layer, hidden, cos_sin)
            got, want, calls = _on_and_off(layer, hidden, cos_sin, monkeypatch)
            torch.testing.assert_close(got, want, **TOL)
            assert calls == ["pre", "post"]


def test_threads_split_outputs_not_sums(monkeypatch):
    """At smollm2-llava's shapes (576 hidden, 9/3 heads of 64, 1536 MLP) the GEMMs' output rows are split
    over 2 threads — the q/k/v and the gate/up products each one parallel region —: every output is
    still one thread's sum in one order, so 2 threads give the 1-thread result bit for bit, and both
    equal the HF layer."""
    cfg = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        attention_bias=True,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(3)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    hidden = torch.randn(4, 1, 576)
    cos_sin = LlamaRotaryEmbedding(cfg)(hidden, torch.arange(4)[:, None] + 300)
    assert decode_layer.fits(layer, hidden, cos_sin[0])
    threads = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.no_grad():
                got[n] = layer_forward(layer, hidden, None, cos_sin)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[1], got[2])
    with torch.no_grad():
        want = layer(hidden, attention_mask=None, position_embeddings=cos_sin)
    torch.testing.assert_close(got[2], want, **TOL)


def test_what_it_cannot_take_runs_the_reference_path(monkeypatch):
    layer, rotary = _llama(bias=True)
    hidden, (cos, sin) = _llama_inputs(layer, rotary, 4, 1)
    with torch.no_grad():
        assert decode_layer.fits(layer, hidden, cos)
        assert not decode_layer.fits(layer, hidden.double(), cos.double())  # not fp32
        assert not decode_layer.fits(layer, hidden.bfloat16(), cos)
        big = torch.randn(decode_layer.MAX_ROWS + 1, 1, 128)  # more rows than the GEMM takes
        assert not decode_layer.fits(layer, big, torch.randn(decode_layer.MAX_ROWS + 1, 1, 32))
        assert not decode_layer.fits(layer, hidden.to("meta"), cos.to("meta"))  # not on the CPU
        monkeypatch.setattr(decode_layer, "FUSED_LAYER", False)
        assert not decode_layer.fits(layer, hidden, cos)  # VLKV_CPU_LAYER=0
        monkeypatch.setattr(decode_layer, "FUSED_LAYER", True)
        monkeypatch.setattr(skinny_gemm, "CPP_GEMM", False)
        assert not decode_layer.fits(layer, hidden, cos)  # VLKV_CPU_GEMM=0: the GEMMs are torch's
        monkeypatch.setattr(skinny_gemm, "CPP_GEMM", True)
    with torch.enable_grad():
        assert not decode_layer.fits(layer, hidden.requires_grad_(), cos)  # a gradient wanted
        hidden = hidden.detach()
        assert decode_layer.fits(layer, hidden, cos)
        assert decode_layer.pre(layer, hidden, cos, sin) is None  # through the weights: refused in C++
        assert decode_layer.post(layer, hidden[:, :, None], hidden) is None
    with torch.no_grad():
        layer.mlp.act_fn = torch.nn.GELU()  # another activation
        assert not decode_layer.fits(layer, hidden, cos)


def _strided(rows: int, cols: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(cols, rows).t() * 0.2)  # (rows, cols), column-major


@pytest.mark.parametrize("where", ["q_proj", "down_proj"])
def test_refused_weights_fall_back_to_the_reference_path(where, monkeypatch):
    """A weight the C++ side cannot stream (not row-major here) is refused there: the layer runs the
    reference path for that half and still equals the HF layer."""
    layer, rotary = _llama(bias=False)
    hidden, cos_sin = _llama_inputs(layer, rotary, 4, 1)
    if where == "q_proj":
        layer.self_attn.q_proj.weight = _strided(128, 128)
    else:
        layer.mlp.down_proj.weight = _strided(128, 320)
    with torch.no_grad():
        assert decode_layer.fits(layer, hidden, cos_sin[0])  # the Python side does not look at weights
        assert (decode_layer.pre(layer, hidden, *cos_sin) is None) is (where == "q_proj")
        assert (decode_layer.post(layer, torch.randn(4, 1, 4, 32), hidden) is None) is (where == "down_proj")
        got, want, calls = _on_and_off(layer, hidden, cos_sin, monkeypatch)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(
            got, layer(hidden, attention_mask=None, position_embeddings=cos_sin), **TOL
        )
    assert calls == ["pre", "post"]  # each half asked on its own: a refused one runs the separate calls


def test_weights_not_fp32_are_refused():
    layer, rotary = _llama(bias=True)
    hidden, (cos, sin) = _llama_inputs(layer, rotary, 2, 1)
    with torch.no_grad():
        layer.self_attn.k_proj.half()
        assert decode_layer.pre(layer, hidden, cos, sin) is None
        layer.mlp.gate_proj.bfloat16()
        assert decode_layer.post(layer, torch.randn(2, 1, 4, 32), hidden) is None


def test_a_parametrized_weight_is_refused(monkeypatch):
    """A weight computed by a parametrization (no ``weight`` parameter of its own) is not streamed: the
    reference path runs, through the module's computed weight."""
    from torch.nn.utils import parametrize

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    layer, rotary = _llama(bias=False)
    hidden, cos_sin = _llama_inputs(layer, rotary, 3, 1)
    parametrize.register_parametrization(layer.self_attn.v_proj, "weight", Doubled())
    parametrize.register_parametrization(layer.mlp.gate_proj, "weight", Doubled())
    with torch.no_grad():
        assert decode_layer.pre(layer, hidden, *cos_sin) is None
        assert decode_layer.post(layer, torch.randn(3, 1, 4, 32), hidden) is None
        got, want, _ = _on_and_off(layer, hidden, cos_sin, monkeypatch)
        torch.testing.assert_close(
            got, layer(hidden, attention_mask=None, position_embeddings=cos_sin), **TOL
        )
        torch.testing.assert_close(got, want, **TOL)


def test_the_raw_kernel_refuses_in_one_line():
    mod = decode_layer.kernel()
    w = torch.randn(64, 16)
    c = torch.randn(4, 1, 8)
    with pytest.raises(RuntimeError, match="layer_pre: float32 contiguous CPU hidden"):
        mod.layer_pre(torch.randn(4, 16), torch.ones(16), 1e-5, w, None, w, None, w, None, c, c)
    with pytest.raises(RuntimeError, match="layer_pre: 1 <= B \\* S <= 8 rows, got 9"):
        mod.layer_pre(torch.randn(9, 1, 16), torch.ones(16), 1e-5, w, None, w, None, w, None, c, c)
    with pytest.raises(RuntimeError, match="layer_pre: norm \\(E,\\), q"):
        mod.layer_pre(torch.randn(4, 1, 16), torch.ones(15), 1e-5, w, None, w, None, w, None, c, c)
    with pytest.raises(RuntimeError, match="layer_post: float32 contiguous CPU residual"):
        bad = torch.randn(16, 1, 4).transpose(0, 2)  # (4, 1, 16), not row-major
        mod.layer_post(torch.randn(4, 1, 2, 8), bad, w, None, torch.ones(16), 1e-5, w, None, w, None, w, None)
    with pytest.raises(RuntimeError, match="layer_post: o \\(E, H \\* D\\), norm"):
        wo, wg, wd = torch.randn(16, 16), torch.randn(40, 16), torch.randn(16, 41)  # down of another width
        mod.layer_post(
            torch.randn(4, 1, 2, 8),
            torch.randn(4, 1, 16),
            wo,
            None,
            torch.ones(16),
            1e-5,
            wg,
            None,
            wg,
            None,
            wd,
            None,
        )


def test_without_a_compiler_the_reference_path_runs(monkeypatch):
    import torch.utils.cpp_extension as ext

    def no_compiler(*a, **k):
        raise OSError("no c++ compiler")

    monkeypatch.setattr(ext, "load_inline", no_compiler)
    monkeypatch.setattr(paged_cpu_kernel, "_is_cached", lambda name: True)  # no "building" line
    monkeypatch.setattr(decode_layer, "_BUILT", [])
    with pytest.warns(
        UserWarning, match="CPU decode layer not built \\(OSError\\): using the skinny layer's calls"
    ):
        assert decode_layer.kernel() is None
    layer, rotary = _llama(bias=False)
    hidden, cos_sin = _llama_inputs(layer, rotary, 2, 1)
    with torch.no_grad():
        assert not decode_layer.fits(layer, hidden, cos_sin[0])
        got = layer_forward(layer, hidden, None, cos_sin)
        torch.testing.assert_close(
            got, layer(hidden, attention_mask=None, position_embeddings=cos_sin), **TOL
        )


def test_the_switch_reads_vlkv_cpu_layer():
    got = switch_values("vlkv.plugins.decode_layer", "FUSED_LAYER", "VLKV_CPU_LAYER", ["0", "1", ""])
    assert got == {"0": "False", "1": "True", "": "True"}


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_generation_with_and_without_the_fused_layer_gives_the_same_tokens(name, policy, images, monkeypatch):
    """Engine decode steps (the fused append-and-read between the two calls; H2O with its statistics)
    give the same greedy tokens with the fused layer as with the skinny layer's separate calls."""
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.prompt import Prompt

    engine = Engine(load_model(name))
    prompts = [
        Prompt("Describe the picture.", [images[0]]),
        Prompt("Write a short poem about caches."),
        Prompt("Hi"),
    ]
    settings = {"budget": 0.5} if policy == "h2o" else {}
    monkeypatch.setattr(decode_layer, "FUSED_LAYER", False)
    want = engine.generate(prompts, make_policy(policy, **settings), 8, stop_at_eos=False)
    monkeypatch.setattr(decode_layer, "FUSED_LAYER", True)
    calls = []
    real = decode_layer.kernel()
    counted = type("Counted", (), {})()
    counted.layer_pre = lambda *a: (calls.append("pre"), real.layer_pre(*a))[1]
    counted.layer_post = lambda *a: (calls.append("post"), real.layer_post(*a))[1]
    monkeypatch.setattr(decode_layer, "kernel", lambda: counted)
    got = engine.generate(prompts, make_policy(policy, **settings), 8, stop_at_eos=False)
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]
    layers = len(engine.backend.adapter.layers)
    # every decode step (7 of the 8 tokens, 3 rows) ran both calls in every layer
    assert calls.count("pre") >= 7 * layers and calls.count("post") == calls.count("pre")


@pytest.mark.slow
@pytest.mark.demo
def test_smollm2_llava_fused_decode_layer_gives_the_same_tokens(monkeypatch):
    """The real-weight decoder at 4 decode rows: the fused decode layer (``decode_layer``: two C++ calls
    per layer outside attention, the default) and the skinny layer's separate calls
    (``VLKV_CPU_LAYER=0``) decode the same greedy tokens, and the fused calls ran in every layer."""
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.photos import real_photos
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.prompt import Prompt

    engine = Engine(load_model("smollm2-llava"))
    photos = real_photos()
    prompts = [
        Prompt("Describe this picture.", [photos[0]]),
        Prompt("The capital of France is"),
        Prompt("What is in the image? Answer in one sentence.", [photos[1]]),
        Prompt("Write one sentence about lighthouses."),
    ]
    monkeypatch.setattr(decode_layer, "FUSED_LAYER", False)
    want = engine.generate(prompts, make_policy("full"), 12, stop_at_eos=False)
    monkeypatch.setattr(decode_layer, "FUSED_LAYER", True)
    calls = []
    real_pre = decode_layer.pre
    monkeypatch.setattr(decode_layer, "pre", lambda *a: (calls.append(1), real_pre(*a))[1])
    got = engine.generate(prompts, make_policy("full"), 12, stop_at_eos=False)
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]
    assert len(calls) >= 11 * len(engine.backend.adapter.layers)  # every decode step, every layer
