"""The position-biased projector: a file with ``position_bias`` installs it and shifts each image token
by exactly its patch's bias; a file without it loads exactly as before; the ONNX vision export carries
the bias."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from vlkv.runtime.models import smollm2_llava as S
from vlkv.runtime.models.projector_position import POSITION_KEY, PositionBiasedProjector, install
from vlkv.runtime.models.registry import load_model

PATCHES = 16  # tiny-llava: 56 px, patch 14


def _state(model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # about the scale of HF's own initialisation, so ONNX Runtime's summation order stays within 1e-5
    proj = model.model.multi_modal_projector.state_dict()
    return {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in proj.items()}


def _images(seed: int) -> torch.Tensor:
    return torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


def _features(model, images) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(model.model.get_image_features(pixel_values=images).pooler_output)


def _plain_again(model, state: dict, images: torch.Tensor, plain: torch.Tensor) -> None:
    """A file without the extra key, applied after one with it, puts the plain MLP back: same tokens."""
    S.apply_projector(model, state)
    assert type(model.model.multi_modal_projector) is LlavaMultiModalProjector
    torch.testing.assert_close(_features(model, images), plain, rtol=0, atol=0)


def _onnx_vision_tokens(model, tmp_path) -> tuple[np.ndarray, torch.Tensor]:
    """The installed projector's vision encoder exported to ONNX (dynamic batch) and run by ONNX Runtime on
    two new images: ``(ORT's tokens (2, tokens, hidden), the images (2, 3, 56, 56))``."""
    ort = pytest.importorskip("onnxruntime")  # optional peer: the exporter's ONNX Runtime check
    from vlkv.exporter.vision_onnx import VisionCase, export_vision
    from vlkv.exporter.vision_tower import vision_encoder

    path = tmp_path / "vision.onnx"
    case = VisionCase("b2", {"input": _images(10)})
    export_vision(vision_encoder(model, "llava"), "llava", case, path, opset=17, dynamic_batch=True)
    images = _images(11)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": images.numpy()})[0], images


def test_a_file_without_the_bias_loads_exactly_as_before(tiny, monkeypatch):
    state = _state(tiny.model, 1)
    before = tiny.model.model.multi_modal_projector
    # the code path before this change: load the four tensors into the plain MLP in place
    reference = load_model("tiny-llava").model
    reference.model.multi_modal_projector.load_state_dict(state, strict=True, assign=True)
    monkeypatch.setattr(S, "NUM_IMAGE_TOKENS", PATCHES)
    S.apply_projector(tiny.model, state)
    assert tiny.model.model.multi_modal_projector is before  # the same module, not a replacement
    assert type(before) is LlavaMultiModalProjector
    images = _images(2)
    torch.testing.assert_close(_features(tiny.model, images), _features(reference, images), rtol=0, atol=0)


def test_a_file_with_the_bias_shifts_image_tokens_by_it_only(tiny, monkeypatch):
    monkeypatch.setattr(S, "NUM_IMAGE_TOKENS", PATCHES)
    state = _state(tiny.model, 3)
    S.apply_projector(tiny.model, state)
    images = _images(4)
    plain = _features(tiny.model, images)
    ids = torch.tensor([[1, 5, 9, 17, 3]])
    with torch.no_grad():
        text_logits = tiny.model(input_ids=ids).logits
    bias = torch.randn(PATCHES, plain.shape[-1], generator=torch.Generator().manual_seed(5))
    S.apply_projector(tiny.model, state | {POSITION_KEY: bias})
    proj = tiny.model.model.multi_modal_projector
    assert isinstance(proj, PositionBiasedProjector)
    biased = _features(tiny.model, images)
    # the same MLP (bit for bit) plus patch p's bias on every image's token p
    torch.testing.assert_close(biased, plain + bias, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(tiny.model(input_ids=ids).logits, text_logits, rtol=0, atol=0)
    _plain_again(tiny.model, state, images, plain)


def test_a_bias_of_the_wrong_size_is_one_line(tiny, monkeypatch):
    monkeypatch.setattr(S, "NUM_IMAGE_TOKENS", PATCHES)
    state = _state(tiny.model, 6) | {POSITION_KEY: torch.zeros(PATCHES + 1, 64)}
    with pytest.raises(ValueError) as err:
        S.apply_projector(tiny.model, state)
    assert "\n" not in str(err.value) and "position_bias is (17, 64)" in str(err.value)


def test_a_file_holding_the_bias_passes_the_checksum_and_key_checks(tmp_path):
    from safetensors.torch import save_file

    state = {k: torch.zeros(s) for k, s in [("linear_1.weight", (4, 2)), ("linear_1.bias", (4,))]}
    state |= {"linear_2.weight": torch.zeros(4, 4), "linear_2.bias": torch.zeros(4)}
    path = tmp_path / "biased.safetensors"
    save_file(state | {POSITION_KEY: torch.ones(3, 4)}, path)
    loaded = S.load_projector(path, sha256=S._sha256(path))
    assert set(loaded) == S.PROJECTOR_KEYS | {POSITION_KEY}
    with pytest.raises(ValueError, match="damaged"):
        S.load_projector(path, sha256="0" * 64)
    save_file({POSITION_KEY: torch.ones(3, 4)}, path)  # a bias alone is not a projector
    with pytest.raises(ValueError, match="holds \\['position_bias'\\]"):
        S.load_projector(path, sha256=S._sha256(path))


def test_install_keeps_the_callers_random_state(tiny):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    install(tiny.model, _state(tiny.model, 7) | {POSITION_KEY: torch.zeros(PATCHES, 64)})
    assert torch.equal(torch.rand(3), expected)


def test_the_onnx_vision_export_carries_the_bias(tiny, tmp_path):
    bias = torch.randn(PATCHES, 64, generator=torch.Generator().manual_seed(8))
    install(tiny.model, _state(tiny.model, 9) | {POSITION_KEY: bias})
    got, images = _onnx_vision_tokens(tiny.model, tmp_path)
    expected = _features(tiny.model, images)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        tiny.model.model.multi_modal_projector.position_bias.zero_()
    assert np.abs(got - _features(tiny.model, images).numpy()).max() > 1.0  # the graph does add it
