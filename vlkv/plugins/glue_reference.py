"""PyTorch references of the device path's decoder-layer glue (``triton_glue.py``): the HF formulas
(``LlamaRMSNorm.forward``, ``apply_rotary_pos_emb``, ``act_fn(gate) * up``) on the fused layouts the
kernels take. Also the CPU fallback of the launchers when Triton is not there."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x (R, N)``, ``weight (N,)`` (x's dtype) → ``(R, N)``: HF's RMSNorm (fp32 statistics, the normed
    rows rounded to the dtype, then times the weight)."""
    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``residual + x`` (both ``(R, N)``) and its :func:`rms_norm_reference`: the decoder layer's residual
    add after attention and the post-attention norm."""
    total = residual + x
    return total, rms_norm_reference(total, weight, eps)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
    """``x (B·Q, H_all, D)``: its first ``heads`` heads rotated (``cos / sin (B, Q, D)``, x's dtype), the
    rest as they were; a new tensor."""
    b, q, d = cos.shape
    out = x.clone()
    part = x[:, :heads].view(b, q, heads, d)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    rot = torch.cat((-part[..., d // 2 :], part[..., : d // 2]), dim=-1)
    out[:, :heads] = (part * c + rot * s).view(b * q, heads, d)
    return out


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    """``gate_up (R, 2·I)`` (gate then up) → ``(R, I)``: ``silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def pool_write_reference(
    k_pool: Tensor, v_pool: Tensor, prerope: Tensor, ids: Tensor, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """New ``k_pool, v_pool (H_kv, S, D)`` and ``prerope (H_kv, S)`` with request ``b``'s rows of
    ``k, v (B, H_kv, 1, D)`` at slots ``ids (H_kv, B)`` and those flags False (the pool's ``write``)."""
    kp, vp, flags = k_pool.clone(), v_pool.clone(), prerope.clone()
    heads = torch.arange(ids.shape[0])[:, None].expand_as(ids)
    kp[heads, ids] = k[:, :, 0].transpose(0, 1).to(kp.dtype)
    vp[heads, ids] = v[:, :, 0].transpose(0, 1).to(vp.dtype)
    flags[heads, ids] = False
    return kp, vp, flags
