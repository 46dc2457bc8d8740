"""The trained projector shipped with smollm2-llava: checksum pinned in code, verified on every build,
a missing or damaged file is one line naming it (never a silent fall back to random weights), and the
file is package data so an installed vlkv has it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlkv.runtime.models import smollm2_llava as S
from vlkv.runtime.models.registry import ModelLoadError, load_model

ROOT = Path(__file__).resolve().parents[3]


def test_shipped_file_matches_the_pinned_checksum():
    assert S.PROJECTOR_FILE.is_file()
    assert S._sha256(S.PROJECTOR_FILE) == S.PROJECTOR_SHA256
    state = S.load_projector()
    # stage 2 (docs/benchmarks/2026-11-27-stage2-cpu-x86_64, run C): rank-8 adapters on the attention
    # projections of all 30 decoder layers, A (8, in) and B (out, 8); k/v project to 3 KV heads x 64
    out = {"q_proj": 576, "k_proj": 192, "v_proj": 192, "o_proj": 576}
    adapters = {
        f"lm_lora.{layer}.{proj}.{part}": (8, 576) if part == "A" else (width, 8)
        for layer in range(30)
        for proj, width in out.items()
        for part in "AB"
    }
    assert (
        {k: tuple(v.shape) for k, v in state.items()}
        == {
            "linear_1.weight": (576, 384),
            "linear_1.bias": (576,),
            "linear_2.weight": (576, 576),
            "linear_2.bias": (576,),
            "token_pool": (),  # 2x2 pooling: 64 image tokens per image (docs/benchmarks/2026-11-27-vqa8-cpu-x86_64)
        }
        | adapters
    )
    assert state.pop("token_pool").item() == 2
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in state.values())


def test_weights_are_package_data():
    # (tomllib is 3.11+; vlkv supports 3.10) the package-data line for this package, read as a list
    line = re.search(r'^"vlkv.runtime.models" = \[(.*)\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert line, "pyproject.toml has no package-data entry for vlkv.runtime.models"
    patterns = [p.strip().strip('"') for p in line.group(1).split(",")]
    rel = S.PROJECTOR_FILE.relative_to(ROOT / "vlkv" / "runtime" / "models")
    assert any(rel.match(p) for p in patterns)


def _damaged(tmp_path: Path) -> Path:
    data = bytearray(S.PROJECTOR_FILE.read_bytes())
    data[len(data) // 2] ^= 0x01
    path = tmp_path / "projector.safetensors"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("make", "what"), [(lambda p: p / "absent.safetensors", "is missing"), (_damaged, "is damaged")]
)
def test_missing_or_damaged_file_is_one_line_naming_it(tmp_path, monkeypatch, make, what):
    path = make(tmp_path)
    with pytest.raises(ValueError) as err:
        S.load_projector(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and what in message
    # build() checks it before anything else and never falls back to the random projector
    monkeypatch.setattr(S, "PROJECTOR_FILE", path)
    monkeypatch.setattr(S, "_build_base", lambda *a: pytest.fail("built without a verified projector"))
    with pytest.raises(ModelLoadError) as err:
        load_model("smollm2-llava")
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "cannot build 'smollm2-llava'" in message


def test_wrong_tensors_are_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"weight": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="holds \\['weight'\\]"):
        S.load_projector(path, sha256=S._sha256(path))


def test_random_projector_keeps_its_name(monkeypatch):
    """smollm2-llava-random builds the seeded projector and never reads the trained file."""
    from vlkv.runtime.models.tiny import build_tiny_llava

    with pytest.raises(ValueError, match="projector must be one of"):
        S.build(projector="other")
    seen = []

    def fake_build(dtype=torch.float32, projector="trained"):
        seen.append(projector)
        return build_tiny_llava(dtype=dtype)

    monkeypatch.setattr(S, "build", fake_build)
    assert load_model("smollm2-llava-random").name == "smollm2-llava-random"
    assert load_model("smollm2-llava").name == "smollm2-llava"
    assert seen == ["random", "trained"]


@pytest.mark.slow
@pytest.mark.demo
def test_built_model_carries_the_trained_projector():
    model, processor = S.build()
    state = S.load_projector()
    for key, value in model.model.multi_modal_projector.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    # the shipped projector pools 2x2 patches: the processor and the projector agree on 64 tokens
    image = Image.new("RGB", (256, 256), (128, 128, 128))
    inputs = processor(text=[S.prompt_template("What is it?", 1)], images=[image], return_tensors="pt")
    assert (inputs["input_ids"] == model.config.image_token_id).sum().item() == S.NUM_IMAGE_TOKENS // 4 == 64
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True)
    assert features.pooler_output[0].shape == (64, 576)
    random_model, random_processor = S.build(projector="random")
    random_ids = random_processor(
        text=[S.prompt_template("What is it?", 1)], images=[image], return_tensors="pt"
    )
    assert (random_ids["input_ids"] == model.config.image_token_id).sum().item() == S.NUM_IMAGE_TOKENS
    random_weight = random_model.model.multi_modal_projector.linear_2.weight
    assert not torch.equal(random_weight, state["linear_2.weight"])
    # both come from the one cache: it holds the seeded projector and the base LM; the trained model
    # then adds the file's adapters B A into the attention projections. So the LMs are equal with the
    # adapters taken off, and only the adapters' target weights differ
    trained_lm = model.model.language_model.state_dict()
    changed = set()
    for key, value in random_model.model.language_model.state_dict().items():
        layer, proj = key.split(".")[1], key.split(".")[-2]
        pair = f"lm_lora.{layer}.{proj}."
        if key.endswith("_proj.weight") and pair + "A" in state:
            delta = state[pair + "B"] @ state[pair + "A"]
            torch.testing.assert_close(trained_lm[key], value + delta, rtol=0, atol=0)
            assert delta.abs().max() > 0
            changed.add(key)
        else:
            torch.testing.assert_close(trained_lm[key], value, rtol=0, atol=0)
    assert len(changed) == sum(k.endswith(".A") for k in state) == 120


@pytest.mark.slow
@pytest.mark.demo
def test_trained_vision_side_exports_to_onnx_with_its_pooling(tmp_path):
    """The exporter's vision encoder of the shipped (pooled) model gives HF's 64 image tokens, and its
    ONNX graph run by ONNX Runtime gives them too (float32, reduction-order tolerance)."""
    ort = pytest.importorskip("onnxruntime")  # optional peer: the exporter's ONNX Runtime check
    from vlkv.exporter.vision_onnx import VisionCase, export_vision
    from vlkv.exporter.vision_tower import vision_encoder

    model, _ = S.build()
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(2, 3, S.IMAGE_SIZE, S.IMAGE_SIZE, generator=gen)
    encoder = vision_encoder(model, "llava")
    with torch.no_grad():
        expected = model.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        exported = encoder(pixels)
    assert exported.shape == (2, 64, 576)
    torch.testing.assert_close(exported, torch.stack(list(expected)), rtol=0, atol=0)
    path = tmp_path / "vision.onnx"
    export_vision(
        encoder, "llava", VisionCase("b1", {"input": pixels[:1]}), path, opset=17, dynamic_batch=True
    )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {"input": pixels.numpy()})[0])
    torch.testing.assert_close(got, exported, rtol=1e-4, atol=1e-4)
