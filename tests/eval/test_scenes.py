"""Procedural scenes: split pairs, objects inside the centre crop and in their own thirds, the training
mix's answers, and the scene-drawing command."""

from __future__ import annotations

import numpy as np
import pytest

from vlkv.eval import scene_tasks as T
from vlkv.eval import scenes as S


def test_splits_partition_the_pairs():
    train, held = set(S.pairs("train")), set(S.pairs("heldout"))
    assert held == S.HELD_OUT and not train & held
    assert len(train) + len(held) == len(S.COLOURS) * len(S.SHAPES)
    # every colour and every shape is still seen in training, each with many partners
    assert {c for c, _ in train} == set(S.COLOURS) and {s for _, s in train} == set(S.SHAPES)
    assert min(sum(c == colour for c, _ in train) for colour in S.COLOURS) >= 5
    assert min(sum(s == shape for _, s in train) for shape in S.SHAPES) >= 5
    assert len(held) / (len(train) + len(held)) <= 0.15
    with pytest.raises(ValueError, match="split must be one of"):
        S.pairs("test")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_objects_stay_in_the_crop_and_their_thirds(n):
    rng = np.random.default_rng(n)
    for _ in range(50):
        scene = S.random_scene(rng, "train", n)
        assert all((o.colour, o.shape) not in S.HELD_OUT for o in scene.objects)
        xs = [o.cx for o in scene.objects]
        assert xs == sorted(xs)
        for o in scene.objects:
            assert o.cx - o.radius >= S.MARGIN and o.cx + o.radius <= S.SIZE - S.MARGIN
            assert o.cy - o.radius >= S.MARGIN and o.cy + o.radius <= S.SIZE - S.MARGIN
            if n == 1:
                assert S.POSITIONS[min(2, int(o.cx // (S.SIZE / 3)))] == o.position
        for a, b in zip(scene.objects, scene.objects[1:]):
            assert a.cx + a.radius < b.cx - b.radius, "objects overlap"
        if n > 1 and not scene.same:
            assert len({(o.colour, o.shape) for o in scene.objects}) == n


def test_image_shows_the_object_colour():
    scene = S.make_scene(["red square"], seed=1)
    pixels = np.asarray(scene.image())
    o = scene.objects[0]
    assert pixels.shape == (S.SIZE, S.SIZE, 3)
    assert tuple(pixels[o.cy, o.cx]) == S.COLOURS["red"]
    assert tuple(pixels[3, 3]) == (scene.grey,) * 3


def test_captions():
    two = S.make_scene(["red star", "blue circle"])
    assert two.caption == "red star and blue circle" and [o.position for o in two.objects] == [
        "left",
        "right",
    ]
    rng = np.random.default_rng(0)
    counted = S.random_scene(rng, "train", 3, same=True)
    assert counted.same and counted.caption.startswith("three ") and counted.caption.endswith("s")


def test_training_mix_answers_follow_the_scene():
    rng = np.random.default_rng(5)
    kinds = set()
    for _ in range(300):
        sample = T.training_sample(rng)
        kinds.add(sample.kind)
        scene = sample.scenes[0]
        if sample.kind == "single-colour":
            assert sample.answer == scene.objects[0].colour
        elif sample.kind == "two-relation":
            assert sample.answer == scene.objects[0].name and scene.objects[1].name in sample.question
        elif sample.kind == "count":
            assert sample.answer == S.NUMBERS[len(scene.objects)]
        elif sample.kind == "nth-what":
            k = next(i for i, o in enumerate(S.ORDINALS) if f" {o} " in sample.question)
            assert sample.answer == sample.scenes[k].objects[0].name
        for sc in sample.scenes:
            assert all((o.colour, o.shape) not in S.HELD_OUT for o in sc.objects)
    assert {"single", "two", "two-relation", "count", "nth-colour", "which"} <= kinds


def test_scene_command(tmp_path, capsys):
    out = tmp_path / "scene.png"
    assert S.main(["green triangle", "white star", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: green triangle and white star"
    assert out.is_file()
    assert S.main(["pink star", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("scenes: object 'pink star' must be 'COLOUR SHAPE'")


@pytest.mark.parametrize("mix", list(T.MIXES))
def test_every_mix_draws_only_its_kinds(mix):
    rng = np.random.default_rng(1)
    kinds = {T.training_sample(rng, mix=mix).kind.split("-")[0] for _ in range(60)}
    makers = {k.split("-")[0] for k in T.MIXES[mix]}
    assert kinds <= makers | {"nth", "which"} and kinds & makers
    with pytest.raises(ValueError, match="mix must be one of"):
        T.training_sample(rng, mix="none")


def test_new_shapes_are_drawn_where_they_should_be():
    """The diamond, hexagon and cross fill their centre and leave their bounding box's corners."""
    for shape in ("diamond", "hexagon", "cross"):
        scene = S.make_scene([f"orange {shape}"], seed=2)
        pixels, o = np.asarray(scene.image()), scene.objects[0]
        assert tuple(pixels[o.cy, o.cx]) == S.COLOURS["orange"]
        corner = int(o.radius * 0.9)
        assert tuple(pixels[o.cy - corner, o.cx - corner]) == (scene.grey,) * 3, shape


def test_turns_ask_about_the_same_images_and_name_nothing_first():
    rng = np.random.default_rng(3)
    kinds = set()
    for _ in range(200):
        sample = T.training_sample(rng, mix="turns")
        kinds.add(sample.kind)
        names = {o.name for sc in sample.scenes for o in sc.objects} | {
            o.shape for sc in sample.scenes for o in sc.objects
        }
        if sample.kind == "single-turns":
            obj = sample.scenes[0].objects[0]
            qa = dict(((sample.question, sample.answer), *sample.turns))
            assert qa[T.COLOUR_OF_SHAPE] == obj.colour and qa[T.SHAPE_OF] == obj.shape
            assert qa[T.WHAT] == obj.name and len(qa) == 4
        if sample.kind.endswith("-turns"):
            assert sample.turns and not any(n in sample.question for n in names)
        for sc in sample.scenes:
            assert all((o.colour, o.shape) not in S.HELD_OUT for o in sc.objects)
    assert {"single-turns", "two-turns", "count-turns"} <= kinds


def test_mixed_mix_keeps_one_object_captions_and_adds_two_object_ones():
    rng = np.random.default_rng(3)
    samples = [T.training_sample(rng, mix="mixed") for _ in range(200)]
    singles = [s for s in samples if s.kind == "single"]
    twos = [s for s in samples if s.kind == "two"]
    assert 50 <= len(singles) <= 110 and 20 <= len(twos) <= 65  # weights 0.4 and 0.2
    for s in singles:
        assert s.question == T.WHAT and s.answer == s.scenes[0].objects[0].name
    for s in twos:
        left, right = s.scenes[0].objects
        assert s.question == T.WHAT and s.answer == f"{left.name} and {right.name}"
    assert {s.kind for s in samples} == {"single", "single-turns", "two", "two-turns"}
    for s in samples:
        assert all((o.colour, o.shape) not in S.HELD_OUT for o in s.scenes[0].objects)


def test_plurals():
    assert [S.plural(s) for s in ("star", "cross", "diamond")] == ["stars", "crosses", "diamonds"]


def test_picture_labels_name_each_picture_in_the_questions_words():
    """``ordinal`` labels: "The seventh picture:" on the line before the seventh placeholder, only in
    prompts of two or more pictures; ``none`` and one-picture prompts are the template's own."""
    template = "<u>\n<image>\n<image>\n<image>\nQ?<e>"
    labelled = T.label_pictures(template, "<image>", 3)
    assert labelled == (
        "<u>\nThe first picture:\n<image>\nThe second picture:\n<image>\nThe third picture:\n<image>\nQ?<e>"
    )
    assert T.label_pictures(template, "<image>", 3, "none") == template
    assert T.label_pictures("<u>\n<image>\nQ?", "<image>", 1) == "<u>\n<image>\nQ?"
    # the label holds the question's own words: "the seventh picture"
    assert "seventh picture" in T.NTH_COLOUR.format(ordinal="seventh")
    with pytest.raises(ValueError, match="labels must be one of"):
        T.label_pictures(template, "<image>", 3, "numbers")
    with pytest.raises(ValueError, match="2 image placeholder"):
        T.label_pictures("<image><image>", "<image>", 3)
    with pytest.raises(ValueError, match="up to 10 pictures"):
        T.label_pictures("<image>" * 11, "<image>", 11)


def test_prompt_text_labels_the_models_template(loaded_models):
    loaded = loaded_models["tiny-llava"]
    assert T.prompt_text(loaded, "Q?", 2) == loaded.prompt_template("Q?", 2)
    assert T.prompt_text(loaded, "Q?", 1, "ordinal") == loaded.prompt_template("Q?", 1)
    text = T.prompt_text(loaded, "Q?", 2, "ordinal")
    assert text.count(loaded.image_placeholder) == 2 and "The second picture:" in text


def test_side_questions_ask_each_side_whole_or_by_attribute():
    rng = np.random.default_rng(5)
    samples = [T.training_sample(rng, mix="sides") for _ in range(200)]
    sides = [s for s in samples if s.kind == "two-sides"]
    assert 35 <= len(sides) <= 85  # weight 0.3
    asked = set()
    for s in sides:
        left, right = s.scenes[0].objects
        assert left.cx < right.cx and len(s.turns) == 3
        truth = {}
        for position, obj in (("left", left), ("right", right)):
            truth[T.ON_THE.format(position=position)] = obj.name
            truth[T.COLOUR_ON.format(position=position)] = obj.colour
            truth[T.SHAPE_ON.format(position=position)] = obj.shape
        for question, answer in ((s.question, s.answer), *s.turns):
            assert truth[question] == answer
            asked.add(question)
        assert all((o.colour, o.shape) not in S.HELD_OUT for o in (left, right))
    assert len(asked) == 6
    assert {s.kind for s in samples} == {"single", "single-turns", "two-sides", "two-turns"}


def test_two_multi_mix_asks_about_one_to_five_pictures():
    rng = np.random.default_rng(3)
    samples = [T.training_sample(rng, mix="two-multi") for _ in range(300)]
    multi = [s for s in samples if s.kind.startswith(("nth", "which"))]
    assert {len(s.scenes) for s in multi} == {1, 2, 3, 4, 5}
    assert 0.12 < len(multi) / len(samples) < 0.3  # a fifth of the mix
    for s in multi:
        if s.kind == "which":  # the answer names a picture that is there
            assert s.answer in T.ORDINALS[: len(s.scenes)]
    assert any(s.kind == "two-turns" for s in samples)


def test_two_sides_multi_mix_draws_its_kinds_at_their_weights():
    rng = np.random.default_rng(4)
    samples = [T.training_sample(rng, mix="two-sides-multi") for _ in range(400)]
    kinds = [s.kind for s in samples]
    assert 70 <= kinds.count("two-sides") <= 130  # weight 0.25
    assert {"single", "single-turns", "two", "two-turns", "two-sides"} <= set(kinds)
    assert any(len(s.scenes) > 1 for s in samples)  # several-picture questions are kept
