"""vlkv.eval.text_scenes: scenes told as sentences, the per-step text draws, and the distillation KL."""

from __future__ import annotations

import pytest
import torch

from vlkv.eval.scenes import Obj, Scene
from vlkv.eval.text_scenes import FORMS, describe, describe_scene, distill_kl, draw_forms


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
