"""--question-order (#29): "after" is today's prompt bit for bit; "before" / "both" put the question before
the image placeholders (same count, same order), in the prompt builder, the training script's inputs, the
VQA's prompts and the run's config (checked, checkpointed, a resume refuses another order)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.eval.train_script import tiny_cfg
from vlkv.eval import vqa
from vlkv.eval.scene_tasks import QUESTION_ORDERS, Sample, order_question, prompt_text
from vlkv.eval.scenes import make_scene
from vlkv.runtime.models import smollm2_llava

# the shipped model's template, as its registry entry formats it (no weights needed)
SMOL = SimpleNamespace(
    prompt_template=smollm2_llava.prompt_template, image_placeholder=smollm2_llava.IMAGE_TOKEN
)
Q = "What is on the left?"


def test_after_is_the_template_and_labels_compose_alike(loaded_models):
    for loaded in (SMOL, loaded_models["tiny-llava"]):
        for n in (0, 1, 2, 5):
            assert order_question(loaded, Q, n) == loaded.prompt_template(Q, n)
            assert prompt_text(loaded, Q, n, "ordinal", "after") == prompt_text(loaded, Q, n, "ordinal")
            for order in QUESTION_ORDERS:  # without images the question has one place
                assert order_question(loaded, Q, 0, order) == loaded.prompt_template(Q, 0)


def test_both_and_before_put_the_question_before_the_images():
    head, tail = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
    assert order_question(SMOL, Q, 1, "both") == f"{head}{Q}\n<image>\n{Q}{tail}"
    assert order_question(SMOL, Q, 1, "before") == f"{head}{Q}\n<image>\n{tail}"
    assert order_question(SMOL, Q, 2, "both") == f"{head}{Q}\n<image>\n<image>\n{Q}{tail}"
    # labels go on the image lines, after the question
    labelled = prompt_text(SMOL, Q, 2, "ordinal", "before")
    assert labelled == f"{head}{Q}\nThe first picture:\n<image>\nThe second picture:\n<image>\n{tail}"
    for n in (1, 3):
        for order, count in (("after", 1), ("before", 1), ("both", 2)):
            text = order_question(SMOL, Q, n, order)
            assert text.count("<image>") == n and text.count(Q) == count
            assert (text.index(Q) < text.index("<image>")) == (order != "after")
    with pytest.raises(ValueError, match=r"question order must be one of \['after', 'before', 'both'\]"):
        order_question(SMOL, Q, 1, "middle")


def test_training_inputs_follow_the_order(tp, loaded_models):
    loaded = loaded_models["tiny-llava"]
    sample = Sample((make_scene(["red star", "blue circle"]),), Q, "red star", "two-sides")
    today, n_today = tp.encode(loaded, sample)
    after, n_after = tp.encode(loaded, sample, order="after")
    assert n_after == n_today and torch.equal(after["input_ids"], today["input_ids"])
    both, n_both = tp.encode(loaded, sample, order="both")
    image_id = loaded.model.config.image_token_index
    n_q = len(loaded.processor.tokenizer(Q + "\n", add_special_tokens=False)["input_ids"])
    assert (both["input_ids"] == image_id).sum() == (today["input_ids"] == image_id).sum() > 0
    assert n_both == n_today + n_q  # the question once more, before the image tokens
    first_image = int((both["input_ids"][0] == image_id).nonzero()[0])
    assert first_image == int((today["input_ids"][0] == image_id).nonzero()[0]) + n_q
    # the answer part (tokens and mask) is the same after either prompt
    assert torch.equal(both["input_ids"][0, n_both:], today["input_ids"][0, n_today:])
    assert torch.equal(both["answer_mask"][n_both:], today["answer_mask"][n_today:])
    # description (text-form) prompts keep their order
    text, _ = tp.encode(loaded, sample, text_form="sides", order="both")
    assert torch.equal(text["input_ids"], tp.encode(loaded, sample, text_form="sides")[0]["input_ids"])


def test_config_checks_saves_and_resume_refuses_another_order(tp, tmp_path):
    with pytest.raises(
        ValueError, match=r"question_order must be one of \['after', 'before', 'both'\], got 'x'"
    ):
        tiny_cfg(tp, question_order="x")
    assert tiny_cfg(tp).question_order == "after"
    cfg = tiny_cfg(tp, mix="two-multi", steps=2, question_order="both")
    tp.train(cfg, tmp_path / "b", stop_at=1, quiet=True)
    assert (
        torch.load(tmp_path / "b" / tp.CHECKPOINT, weights_only=False)["config"]["question_order"] == "both"
    )
    with pytest.raises(ValueError, match="other settings"):
        tp.train(tiny_cfg(tp, mix="two-multi", steps=2), tmp_path / "b", resume=True, quiet=True)
    both = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    after = tp.train(tiny_cfg(tp, mix="two-multi", steps=2), tmp_path / "a", quiet=True)
    assert any(not torch.equal(both[k], after[k]) for k in both)  # the order reached the loss


def test_vqa_prompts_and_flag(loaded_models, capsys):
    loaded = loaded_models["tiny-llava"]
    item = next(i for i in vqa.build_set(n_single=0, n_two=1, n_multi=0) if i.group == "two")
    plain = vqa._prompt(loaded, item, "none", "after")
    assert not plain.raw and plain.text == item.sample.question  # the engine formats it, as before
    both = vqa._prompt(loaded, item, "none", "both")
    assert both.raw and both.text == prompt_text(loaded, item.sample.question, 1, "none", "both")
    assert vqa.main(["--model", "tiny-llava", "--question-order", "first"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "vqa: --question-order must be one of after, before, both, got 'first'"
