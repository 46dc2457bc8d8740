"""``scripts/bench_image_qa.py``'s helpers: the scene's questions and the span each answer is scored on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_image_qa.py"
sys.path.insert(0, str(SCRIPT.parent))

from bench_image_qa import CONFIGS, _answer_mask, _over_answer, heldout_scenes, scene_questions  # noqa: E402


def test_scene_questions_are_eight_with_their_answers():
    qa = scene_questions(["red circle", "blue square"])
    assert len(qa) == 8 and len({q for q, _ in qa}) == 8
    assert ("What colour is the square?", "blue") in qa and ("Where is the red circle?", "left") in qa
    assert ("What is left of the blue square?", "red circle") in qa
    with pytest.raises(SystemExit, match="two different shapes"):
        scene_questions(["red circle", "blue circle"])
    with pytest.raises(SystemExit, match="two objects"):
        scene_questions(["red circle"])


def test_answers_are_scored_up_to_their_first_end_of_turn():
    answers = torch.tensor([[5, 6, 2, 7, 2], [5, 6, 7, 8, 9], [2, 5, 5, 5, 5]])
    mask = _answer_mask(answers, {2, 3})
    assert mask.tolist() == [
        [True, True, True, False, False],  # through the first end-of-turn token, not after it
        [True, True, True, True, True],  # no end: every token
        [True, False, False, False, False],
    ]
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0, 100.0], [1.0] * 5, [4.0, 9.0, 9.0, 9.0, 9.0]])
    assert _over_answer(mask.double(), x).tolist() == [2.0, 1.0, 4.0]


def test_the_fp32_configs_pin_the_earlier_default():
    assert CONFIGS["kvgrad-replay-fp32"] == ("kvgrad", {"attn_grad": "full", "replay_dtype": "model"})
    assert CONFIGS["kvzip-replay-fp32"] == ("kvzip", {"replay_dtype": "model"})
    assert CONFIGS["kvgrad-replay"] == ("kvgrad", {})  # the policy's default, whatever it is


def test_heldout_scenes_are_two_held_out_objects_of_different_shapes():
    from vlkv.eval.scenes import HELD_OUT

    scenes = heldout_scenes(6)
    assert len(scenes) == 6 and scenes == heldout_scenes(6)  # drawn from a fixed seed
    assert heldout_scenes(6, seed=1) != scenes
    for names in scenes:
        (lc, ls), (rc, rs) = (n.split() for n in names)
        assert (lc, ls) in HELD_OUT and (rc, rs) in HELD_OUT and ls != rs
        assert len(scene_questions(names)) == 8  # every scene takes the eight questions
    with pytest.raises(SystemExit, match="--scenes must be >= 1"):
        heldout_scenes(0)
