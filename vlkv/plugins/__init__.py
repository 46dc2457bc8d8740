"""Kernels and plugins: PyTorch references, Triton kernels, ONNX custom ops, TensorRT plugins.

Module map (names are resolved lazily: ``import vlkv.plugins`` imports neither torch nor triton):
- ``reference``: plain-PyTorch ops, the ground truth (``AttnStats``, ``*_reference``);
- ``ops``: dispatch to the Triton kernels on CUDA (or ``VLKV_FORCE_TRITON=1``), else the references;
- ``*_kernels``: the Triton kernels (pure triton); ``triton_*``: their PyTorch launchers;
- ``paged_reference`` / ``paged_cpu``: paged attention (K/V read through slot tables), its ground truth and
  its CPU form;
- ``onnx_ops``: the ``vlkv`` ONNX domain (specs, node forms); ``onnx_ort``: ONNX Runtime CPU doubles;
- ``ptx``: AOT PTX for the plugin kernels; ``trt_plugins``: TensorRT quickly-deployable plugins.
"""

from __future__ import annotations

import importlib

# Public name -> module that defines it. Explicit on purpose: no scanning, no import side effects.
_EXPORTS: dict[str, str] = {
    "AttnStats": "vlkv.plugins.reference",
    "attn_stats_reference": "vlkv.plugins.reference",
    "selected_attention_reference": "vlkv.plugins.reference",
    "merge_kv_reference": "vlkv.plugins.reference",
    "attn_stats": "vlkv.plugins.ops",
    "selected_attention": "vlkv.plugins.ops",
    "selected_row_stats": "vlkv.plugins.ops",
    "merge_kv": "vlkv.plugins.ops",
    "lowrank_attention": "vlkv.plugins.ops",
    "paged_attention": "vlkv.plugins.ops",
    "paged_attention_reference": "vlkv.plugins.paged_reference",
    "lowrank_decode_attention": "vlkv.plugins.lowrank_reference",
    "compile_ptx": "vlkv.plugins.ptx",
    "PtxArtifact": "vlkv.plugins.ptx",
    "register_plugins": "vlkv.plugins.trt_plugins",
    "TensorRTUnavailableError": "vlkv.plugins.trt_plugins",
    "ort_session_options": "vlkv.plugins.onnx_ort",
    "make_single_op_model": "vlkv.plugins.onnx_ort",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vlkv.plugins' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
