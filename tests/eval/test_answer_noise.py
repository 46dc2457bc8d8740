"""--answer-noise (vlkv.eval.answer_noise) on the tiny LLaVA: one colour / shape answer word is replaced
in the teacher-forced input only, the targets stay the clean tokens, p = 0 changes nothing, the same
seed draws the same corruption, and a corrupted run resumes bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.eval.train_script import tiny_cfg
from vlkv.eval import answer_noise as an
from vlkv.eval.scene_tasks import Sample
from vlkv.eval.scenes import COLOURS, SHAPES, make_scene


@pytest.fixture(scope="module")
def loaded(tp):
    return tp.load("tiny-llava")


def _sample(answer="black hexagon and red circle", turns=(("What is on the left?", "black hexagon"),)):
    return Sample((make_scene(["black hexagon", "red circle"]),), "What is in the image?", answer, "x", turns)


def _batches(tp, p, seed=0, steps=5):
    cfg = tiny_cfg(tp, mix="two-multi", batch=4, seed=seed)
    return [
        an.draws(seed, step, [an.answers(s) for s in tp.batch_for(step, cfg)], p) for step in range(steps)
    ]


def test_corruptible_words_are_colours_and_shapes_with_a_word_after():
    assert an.corruptible("black hexagon and red circle") == [0, 1, 3]
    assert an.corruptible("red circle") == [0]
    assert an.corruptible("red") == [] and an.corruptible("two") == [] and an.corruptible("third") == []


def test_p_zero_draws_nothing_and_the_tokens_are_todays(tp, loaded):
    assert all(swaps == () for step in _batches(tp, 0.0) for swaps in step)
    tok = loaded.processor.tokenizer
    sample = _sample()
    ids, mask, targets = an.answer_tokens(loaded, sample)
    # the sequence the script built before the flag existed: each answer tokenised whole
    want = tok(sample.answer + tok.eos_token, add_special_tokens=False)["input_ids"]
    want += tok("\n" + loaded.prompt_template(sample.turns[0][0], 0), add_special_tokens=False)["input_ids"]
    want += tok("black hexagon" + tok.eos_token, add_special_tokens=False)["input_ids"]
    assert ids[0].tolist() == want and torch.equal(targets, ids[0])
    inputs, n_prompt = tp.encode(loaded, sample)
    assert torch.equal(inputs["targets"], inputs["input_ids"][0])


@pytest.mark.parametrize("word, new", [(0, "purple"), (1, "triangle"), (3, "white")])
def test_only_the_swapped_word_changes_in_the_input_and_targets_stay_clean(tp, loaded, word, new):
    tok = loaded.processor.tokenizer
    sample = _sample()
    clean, mask, clean_targets = an.answer_tokens(loaded, sample)
    ids, mask2, targets = an.answer_tokens(loaded, sample, (an.Swap(0, word, new),))
    words = sample.answer.split()
    corrupted = " ".join(new if j == word else w for j, w in enumerate(words))
    assert tok.decode(ids[0][mask2]).startswith(corrupted + tok.eos_token + "black hexagon")
    # slot by slot: before the word and from the word after it on, inputs and targets are the clean ones
    pieces = [
        tok(w if j == 0 else " " + w, add_special_tokens=False)["input_ids"] for j, w in enumerate(words)
    ]
    start = sum(len(p) for p in pieces[:word])
    n_old, n_new = (
        len(pieces[word]),
        len(tok((" " if word else "") + new, add_special_tokens=False)["input_ids"]),
    )
    assert torch.equal(ids[0, :start], clean[0, :start])
    assert torch.equal(ids[0, start + n_new :], clean[0, start + n_old :])
    assert not torch.equal(ids[0, start : start + n_new], clean[0, start : start + n_old])
    # targets: the clean word's first token where the replacement starts, -100 on its other tokens
    assert targets[start] == clean_targets[start]
    assert (targets[start + 1 : start + n_new] == an.IGNORE).all()
    assert torch.equal(targets[start + n_new :], clean_targets[start + n_old :])
    assert torch.equal(targets[:start], clean_targets[:start])
    # the script feeds these inputs and scores these targets
    inputs, n_prompt = tp.encode(loaded, sample, swaps=(an.Swap(0, word, new),))
    assert torch.equal(inputs["input_ids"][0, n_prompt:], ids[0])
    assert torch.equal(inputs["targets"][n_prompt:], targets)
    logits, scored, _, _ = tp.answer_logits(loaded, sample, swaps=(an.Swap(0, word, new),))
    assert logits.shape[0] == scored.shape[0] == ids.shape[1]
    assert set(scored[scored != -100].tolist()) <= set(clean_targets.tolist())


def test_draws_are_seeded_same_kind_and_follow_p(tp):
    first, again, other = _batches(tp, 0.5), _batches(tp, 0.5), _batches(tp, 0.5, seed=1)
    assert first == again and first != other
    cfg = tiny_cfg(tp, mix="two-multi", batch=4)
    n_answers = n_swapped = 0
    for step, noise in enumerate(_batches(tp, 1.0, steps=8)):
        for sample, swaps in zip(tp.batch_for(step, cfg), noise):
            answers = an.answers(sample)
            n_answers += sum(bool(an.corruptible(a)) for a in answers)
            n_swapped += len(swaps)
            assert len({s.reply for s in swaps}) == len(swaps)  # one swap per answer at most
            for s in swaps:
                old = answers[s.reply].split()[s.word]
                assert s.word in an.corruptible(answers[s.reply]) and s.new != old
                assert (old in COLOURS) == (s.new in COLOURS) and (old in SHAPES) == (s.new in SHAPES)
    assert n_swapped == n_answers > 0  # p = 1: every corruptible answer once
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        an.draws(0, 0, [["red circle"]], 1.5)
    with pytest.raises(ValueError, match="not followed by another word"):
        an.reply_tokens(None, "red circle", "<e>", an.Swap(0, 1, "star"))


def test_a_corrupted_sample_and_its_teacher_share_the_corruption(tp, loaded):
    sample = _sample()
    swaps = (an.Swap(0, 0, "yellow"),)
    image, n_image = tp.encode(loaded, sample, swaps=swaps)
    text, n_text = tp.encode(loaded, sample, text_form="sides", swaps=swaps)
    assert torch.equal(image["input_ids"][0, n_image:], text["input_ids"][0, n_text:])
    with torch.no_grad():
        clean = tp.sample_loss(loaded, sample, text_form="sides", distill=1.0)
        noisy = tp.sample_loss(loaded, sample, text_form="sides", distill=1.0, swaps=swaps)
    assert noisy.isfinite() and noisy != clean


def test_a_corrupted_run_resumes_bit_for_bit_and_keeps_its_setting(tp, tmp_path):
    with pytest.raises(ValueError, match=r"answer_noise must be in \[0, 1\], got -0.1"):
        tiny_cfg(tp, answer_noise=-0.1)
    cfg = tiny_cfg(tp, mix="two-multi", answer_noise=1.0)
    straight = tp.train(cfg, tmp_path / "a", quiet=True)
    tp.train(cfg, tmp_path / "b", stop_at=2, quiet=True)
    resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    assert torch.load(tmp_path / "b" / tp.CHECKPOINT, weights_only=False)["config"]["answer_noise"] == 1.0
    plain = tp.train(tiny_cfg(tp, mix="two-multi"), tmp_path / "c", quiet=True)
    assert any(not torch.equal(plain[k], straight[k]) for k in straight)  # the corruption reached the loss
    with pytest.raises(ValueError, match="other settings"):
        tp.train(tiny_cfg(tp, mix="two-multi"), tmp_path / "b", resume=True, quiet=True)
