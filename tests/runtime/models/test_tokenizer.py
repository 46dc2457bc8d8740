from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from vlkv.runtime.models.tokenizer import build_tokenizer, vocab_size

LLAVA_IDS = {"<pad>": 256, "<s>": 257, "</s>": 258, "<image>": 259}
QWEN_IDS = {
    "<pad>": 256,
    "<s>": 257,
    "</s>": 258,
    "<|im_start|>": 259,
    "<|im_end|>": 260,
    "<|vision_start|>": 261,
    "<|vision_end|>": 262,
    "<|image_pad|>": 263,
    "<|video_pad|>": 264,
}
TEXT = "héllo ✓ 世界\n\t~"


@pytest.mark.parametrize(
    ("family", "ids"), [("llava", LLAVA_IDS), ("llava_next", LLAVA_IDS), ("qwen2_vl", QWEN_IDS)]
)
def test_special_token_ids_are_fixed(family, ids):
    tok = build_tokenizer(family)
    assert {t: tok.convert_tokens_to_ids(t) for t in ids} == ids
    assert len(tok) == vocab_size(family) == 256 + len(ids)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)
    assert tok.image_token_id == ids["<image>" if family != "qwen2_vl" else "<|image_pad|>"]


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_bytes_are_their_own_ids_and_round_trip(family):
    tok = build_tokenizer(family)
    ids = tok(TEXT, add_special_tokens=False).input_ids
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    every_byte = bytes(range(128)).decode("ascii")
    assert tok(every_byte, add_special_tokens=False).input_ids == list(range(128))


def test_llava_prepends_bos_and_qwen_does_not():
    assert build_tokenizer("llava")("ab").input_ids == [257, 97, 98]
    assert build_tokenizer("qwen2_vl")("ab").input_ids == [97, 98]


def test_special_tokens_are_not_split():
    llava = build_tokenizer("llava")
    assert llava("a<image>b", add_special_tokens=False).input_ids == [97, 259, 98]
    qwen = build_tokenizer("qwen2_vl")
    text = "<|vision_start|><|image_pad|><|vision_end|>"
    assert qwen(text).input_ids == [261, 263, 262]
    # The Qwen2-VL specials are plain bytes to the LLaVA tokenizer.
    assert llava("<|im_end|>", add_special_tokens=False).input_ids == list(b"<|im_end|>")


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_save_and_reload_keeps_ids(tmp_path, family):
    tok = build_tokenizer(family)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = f"USER: {tok.image_token}\n{TEXT}"
    assert again(text).input_ids == tok(text).input_ids
    assert again.image_token == tok.image_token
    assert again.padding_side == "left"


def test_unknown_family_is_rejected():
    with pytest.raises(ValueError, match="family must be one of"):
        build_tokenizer("gpt2")
