"""vlkv.eval.text_scenes: scenes told as sentences, the per-step text draws, and the distillation KL."""

from __future__ import annotations

import pytest
import torch

from vlkv.eval.scenes import Obj, Scene
from vlkv.eval.text_scenes import (
    FORMS,
    common_suffix,
    describe,
    describe_scene,
    distill_kl,
    draw_forms,
    hidden_match,
)


def _scene(*objs):
    return Scene(tuple(Obj(c, s, p, 50, 100, 20) for c, s, p in objs), 128, -1)


def test_two_objects_in_both_forms():
    scene = _scene(("red", "star", "left"), ("orange", "circle", "right"))
    assert describe_scene(scene, "caption") == "The image shows a red star and an orange circle."
    assert (
        describe_scene(scene, "sides")
        == "The image shows a red star on the left and an orange circle on the right."
    )


def test_one_object_counts_and_several_pictures():
    one = _scene(("blue", "cross", "middle"))
    assert describe_scene(one, "sides") == "The image shows a blue cross in the middle."
    count = _scene(("green", "cross", "left"), ("green", "cross", "middle"))
    assert describe_scene(count, "sides") == "The image shows two green crosses."
    assert describe((one, count), "caption") == (
        "The first picture shows a blue cross. The second picture shows two green crosses."
    )
    with pytest.raises(ValueError, match="form must be one of"):
        describe_scene(one, "other")


def test_draws_depend_on_seed_and_step_only():
    a = draw_forms(0, 5, 64, 0.5)
    assert a == draw_forms(0, 5, 64, 0.5) and a != draw_forms(0, 6, 64, 0.5)
    assert 10 < sum(t for t, _ in a) < 54 and {f for _, f in a} == set(FORMS)
    assert not any(t for t, _ in draw_forms(0, 5, 8, 0.0)) and all(t for t, _ in draw_forms(0, 5, 8, 1.0))
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        draw_forms(0, 0, 1, 1.5)


def test_distill_kl_matches_its_definition():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    mask = torch.tensor([True, False, True, True, False])
    p, q = teacher[mask].softmax(-1), student[mask].softmax(-1)
    want = (p * (p / q).log()).sum(-1).mean()
    torch.testing.assert_close(distill_kl(student, teacher, mask), want, rtol=1e-5, atol=1e-6)
    assert distill_kl(teacher, teacher, mask).abs() < 1e-6
    assert distill_kl(student, teacher, torch.zeros(5, dtype=torch.bool)) == 0


def test_common_suffix_counts_the_shared_ending():
    t = torch.tensor
    assert common_suffix(t([1, 2, 3, 4]), t([9, 9, 9, 3, 4])) == 2
    assert common_suffix(t([3, 4]), t([1, 3, 4])) == 2
    assert common_suffix(t([1, 2]), t([1, 3])) == 0


def test_hidden_match_compares_the_shared_positions_of_each_layer():
    g = torch.Generator().manual_seed(1)
    teacher = tuple(torch.randn(1, 6, 4, generator=g) for _ in range(3))
    # the student: 2 more leading positions, the last 3 equal to the teacher's but for layer 2's
    student = tuple(torch.cat([torch.randn(1, 5, 4, generator=g), t[:, -3:]], 1) for t in teacher)
    assert hidden_match(student, teacher, 3) == 0
    bumped = (student[0], student[1], student[2] + 1.0)
    tail = teacher[2][0, -3:]
    want = (3 * 4) / tail.pow(2).sum() / 2  # one of the two compared layers (embeddings skipped)
    torch.testing.assert_close(hidden_match(bumped, teacher, 3), want, rtol=1e-5, atol=1e-6)
    assert hidden_match(bumped, teacher, 0) == 0
