"""The fused decode layer's GEMMs and checks (``vlkv/plugins/decode_layer.py`` over ``skinny_gemm``'s kernels).

What must hold: on smollm2-llava's layer shapes (weights far larger than the kernel's 8 KiB prefetch
distance) ``pre`` and ``post`` give the same bits in the kernel's form and in session 7's and 8's
(``set_gemm_form(1)`` / ``(2)``, the benchmarks' befores) for 1-8 rows, and equal the HF layer within fp32 rounding;
the C++ row checks read ``skinny_gemm.MAX_ROWS`` (one source of truth); ``fits`` refuses a ``cos`` that
is not on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from vlkv.plugins import decode_layer, skinny_gemm

# fp32 rounding of reordered sums over K ≤ 1,536 (the HF modules sum in another order)
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(autouse=True)
def _on(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "CPP_GEMM", True)
    monkeypatch.setattr(decode_layer, "FUSED_LAYER", True)
    if decode_layer.kernel() is None:  # a compiler is part of the CPU test environment
        pytest.fail("the decode layer could not be built here")


@pytest.fixture(scope="module")
def smollm2_layer():
    """A decoder layer of smollm2-llava's shapes (hidden 576, MLP 1536, 9 / 3 heads of 64), random weights."""
    cfg = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    return layer, LlamaRotaryEmbedding(cfg)


def _both_forms(fn, form):
    """``fn()`` in the kernel's form and in an earlier one (1: session 7's, 2: session 8's; the decode
    layer's own copy of the flag)."""
    mod = decode_layer.kernel()
    now = fn()
    mod.set_gemm_form(form)
    try:
        before = fn()
    finally:
        mod.set_gemm_form(0)
    return now, before


@pytest.mark.parametrize("form", [1, 2])
@pytest.mark.parametrize("rows", range(1, skinny_gemm.MAX_ROWS + 1))
def test_pre_and_post_give_the_same_bits_in_every_form(smollm2_layer, rows, form):
    layer, rotary = smollm2_layer
    torch.manual_seed(rows)
    hidden = torch.randn(rows, 1, 576)
    cos, sin = rotary(hidden, torch.full((rows, 1), 8200))
    attn_out = torch.randn(rows, 1, 9, 64)
    with torch.no_grad():
        assert decode_layer.fits(layer, hidden, cos)
        pre_now, pre_before = _both_forms(lambda: decode_layer.pre(layer, hidden, cos, sin), form)
        post_now, post_before = _both_forms(lambda: decode_layer.post(layer, attn_out, hidden), form)
        for a, b in zip(pre_now, pre_before, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(post_now, post_before)
        # against the HF modules (the same formulas, torch's sums)
        n = layer.input_layernorm(hidden)
        q = layer.self_attn.q_proj(n).view(rows, 1, 9, 64).transpose(1, 2)
        v = layer.self_attn.v_proj(n).view(rows, 1, 3, 64).transpose(1, 2)
        rot = torch.cat([-q[..., 32:], q[..., :32]], dim=-1)
        torch.testing.assert_close(pre_now[0], q * cos[:, None] + rot * sin[:, None], **TOL)
        torch.testing.assert_close(pre_now[2], v, **TOL)
        h = hidden + layer.self_attn.o_proj(attn_out.reshape(rows, 1, 576))
        torch.testing.assert_close(post_now, h + layer.mlp(layer.post_attention_layernorm(h)), **TOL)


def test_the_row_checks_read_max_rows():
    mod, rows = decode_layer.kernel(), skinny_gemm.MAX_ROWS + 1
    assert f"#define VLKV_MAX_ROWS {skinny_gemm.MAX_ROWS}\n" in decode_layer._SOURCE
    assert "<= 8" not in decode_layer._ENTRY  # no second copy of the limit
    w, c = torch.randn(64, 16), torch.randn(rows, 1, 8)
    with pytest.raises(
        RuntimeError, match=f"layer_pre: 1 <= B \\* S <= {skinny_gemm.MAX_ROWS} rows, got {rows}"
    ):
        mod.layer_pre(torch.randn(rows, 1, 16), torch.ones(16), 1e-5, w, None, w, None, w, None, c, c)
    wo, wg, wd = torch.randn(16, 16), torch.randn(40, 16), torch.randn(16, 40)
    with pytest.raises(
        RuntimeError, match=f"layer_post: 1 <= B \\* S <= {skinny_gemm.MAX_ROWS} rows, got {rows}"
    ):
        mod.layer_post(
            torch.randn(rows, 1, 2, 8),
            torch.randn(rows, 1, 16),
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


def test_fits_wants_cos_on_the_cpu(smollm2_layer):
    layer, rotary = smollm2_layer
    hidden = torch.randn(4, 1, 576)
    cos, _ = rotary(hidden, torch.full((4, 1), 9))
    with torch.no_grad():
        assert decode_layer.fits(layer, hidden, cos)
        assert not decode_layer.fits(layer, hidden, cos.to("meta"))  # the C++ side reads its pointer
