"""A decode layer's RMSNorm and RoPE in C++ (``vlkv/plugins/layer_glue.py``) against the HF modules.

What must hold: ``rms_norm`` equals each HF RMSNorm class it names and ``rope`` equals the modeling
files' ``apply_rotary_pos_emb`` (Llama's 1-D RoPE; Qwen2-VL's, whose cos/sin carry the M-RoPE
sections) within fp32 rounding; what it cannot take goes to the HF modules (``*_fits`` False) or is
refused in one line by the raw kernel; the GEMM's switch turns it off.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb as qwen2_vl_rope

import vlkv.plugins.layer_glue as glue
import vlkv.plugins.skinny_gemm as skinny_gemm

# fp32 rounding of a reordered sum of squares / a fused multiply-add
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _built(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "CPP_GEMM", True)
    if glue.kernel() is None:  # a C++ compiler is part of the CPU test environment
        pytest.fail("the layer glue could not be built here")


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm, Qwen2VLRMSNorm])
@pytest.mark.parametrize("shape", [(1, 1, 576), (4, 1, 576), (3, 5, 65), (2, 1, 1), (64, 17)])
def test_rms_norm_equals_the_hf_module(cls, shape):
    torch.manual_seed(shape[-1])
    norm = cls(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
        x = torch.randn(shape) * 3
        assert glue.norm_fits(norm, x)
        got = glue.rms_norm(norm, x)
        assert got.shape == x.shape and got.is_contiguous()
        torch.testing.assert_close(got, norm(x), **TOL)


@pytest.mark.parametrize("fn", [llama_rope, qwen2_vl_rope], ids=["llama", "qwen2_vl"])
@pytest.mark.parametrize(
    "b,s,hq,hk,d", [(4, 1, 9, 3, 64), (1, 1, 1, 1, 2), (2, 6, 4, 2, 128), (3, 2, 7, 1, 80)]
)
def test_rope_equals_apply_rotary_pos_emb(fn, b, s, hq, hk, d):
    torch.manual_seed(b * s * d)
    q, k = torch.randn(b, s, hq, d), torch.randn(b, s, hk, d)
    cos, sin = torch.randn(b, s, d), torch.randn(b, s, d)
    with torch.no_grad():
        assert glue.rope_fits(q, k, cos, sin)
        gq, gk = glue.rope(q, k, cos, sin)
        wq, wk = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    torch.testing.assert_close(gq.transpose(1, 2), wq, **TOL)
    torch.testing.assert_close(gk.transpose(1, 2), wk, **TOL)


def test_what_it_cannot_take_goes_to_the_hf_modules(monkeypatch):
    norm = LlamaRMSNorm(8)
    x = torch.randn(4, 8)
    q, k, c = torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8), torch.randn(4, 1, 8)
    with torch.no_grad():
        assert glue.norm_fits(norm, x) and glue.rope_fits(q, k, c, c)
        assert not glue.norm_fits(torch.nn.LayerNorm(8), x)  # another formula
        assert not glue.norm_fits(norm, torch.randn(glue.MAX_ROWS + 1, 8))  # a prefill chunk
        assert not glue.norm_fits(norm, x.double())
        assert not glue.rope_fits(q, k, c[:, :, :4], c[:, :, :4])  # cos/sin of another width
        assert not glue.rope_fits(q.bfloat16(), k.bfloat16(), c, c)
        assert not glue.rope_fits(q, torch.randn(2, 2, 2, 8), c, c)  # k of other rows
        assert not glue.rope_fits(q, torch.randn(4, 1, 1, 6), c, c)  # k of another head size
    assert not glue.norm_fits(norm, x)  # gradients wanted through the weight: the module
    monkeypatch.setattr(skinny_gemm, "CPP_GEMM", False)
    with torch.no_grad():
        assert not glue.norm_fits(norm, x) and not glue.rope_fits(q, k, c, c)


def test_the_raw_kernel_refuses_in_one_line():
    mod = glue.kernel()
    with pytest.raises(RuntimeError, match="rms_norm: float32 contiguous"):
        mod.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="rope: q \\(B, S, Hq, D\\)"):
        mod.rope(torch.randn(4, 1, 2, 7), torch.randn(4, 1, 1, 7), torch.randn(4, 1, 7), torch.randn(4, 1, 7))
    with pytest.raises(RuntimeError, match="rope: float32 contiguous"):
        q = torch.randn(4, 1, 8, 2).transpose(2, 3)  # (4, 1, 2, 8), not row-major
        mod.rope(q, torch.randn(4, 1, 1, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8))
