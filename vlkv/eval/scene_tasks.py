"""Questions about procedural scenes: one phrasing per question kind, shared by training and the VQA set.

A :class:`Sample` is some scenes (one image each), a question and its exact answer. The training
mix (:func:`training_sample`) draws every kind; the evaluation set (:mod:`vlkv.eval.vqa`) asks the
same phrasings about held-out pairs only, so the model is never asked in a form it was not taught.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vlkv.eval.scenes import NUMBERS, ORDINALS, SHAPES, Scene, pairs, plural, random_scene

WHAT = "What is in the image?"
COLOUR_OF_SHAPE = "What colour is the shape?"
SHAPE_OF = "What shape is it?"
WHERE = "Where is the {name}?"
HOW_MANY = "How many {shapes} are there?"
COLOUR_OF = "What colour is the {shape}?"
LEFT_OF = "What is left of the {name}?"
ON_THE = "What is on the {position}?"
# side questions that ask one attribute: the answer is a colour or a shape word alone, so no
# colour-shape pair (all of them training pairs) is learnt as a unit from them
COLOUR_ON = "What colour is on the {position}?"
SHAPE_ON = "What shape is on the {position}?"
NTH_COLOUR = "What colour is the shape in the {ordinal} picture?"
NTH_WHAT = "What is in the {ordinal} picture?"
WHICH_HAS = "Which picture has {count} {shapes}?"
# Picture labels: how each picture of a several-picture prompt is introduced (``"none"``: the bare
# template, one placeholder per line). ``"ordinal"`` writes "The seventh picture:" on the line before
# the seventh image, the question's own words, so the LM can find "the seventh picture" (and answer
# "which picture") by matching text instead of counting 256-token image spans.
LABELS = ("none", "ordinal")
PICTURE_LABEL = "The {ordinal} picture:\n"
# Where the question stands (#29): "after" the image(s) (the model's own template, the product's
# prompt), "before" them only, or "both". The image tokens attend causally, so only a question
# before them lets the LM prepare, at the image positions, the object it asks about; "both" keeps
# the question right before the answer as well.
QUESTION_ORDERS = ("after", "before", "both")


@dataclass(frozen=True)
class Sample:
    """``scenes`` in prompt order (one image each), a question, its exact answer and its kind.

    ``turns``: follow-up (question, answer) turns about the same images, for training only: the
    images are encoded once and every answer is supervised (the evaluation asks ``question`` alone).
    """

    scenes: tuple[Scene, ...]
    question: str
    answer: str
    kind: str
    turns: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.scenes:
            raise ValueError("scenes must hold at least one scene")
        if not self.answer:
            raise ValueError("answer must not be empty")


def label_pictures(prompt: str, placeholder: str, n_images: int, labels: str = "ordinal") -> str:
    """``prompt`` (a formatted template) with a label line before each image placeholder.

    Only prompts of two or more pictures are labelled (one picture needs no name, so one-image
    prompts stay the template's own); ``labels="none"`` returns ``prompt`` unchanged.
    """
    if labels not in LABELS:
        raise ValueError(f"labels must be one of {list(LABELS)}, got {labels!r}")
    parts = prompt.split(placeholder)
    if len(parts) != n_images + 1:
        raise ValueError(f"prompt has {len(parts) - 1} image placeholder(s), expected {n_images}")
    if labels == "none" or n_images < 2:
        return prompt
    if n_images > len(ORDINALS):
        raise ValueError(f"ordinal labels go up to {len(ORDINALS)} pictures, got {n_images}")
    out = parts[0]
    for k, rest in enumerate(parts[1:]):
        out += PICTURE_LABEL.format(ordinal=ORDINALS[k]) + placeholder + rest
    return out


def order_question(loaded, question: str, n_images: int, order: str = "after") -> str:
    """The model's template for ``question`` about ``n_images`` pictures, the question placed per ``order``.

    "after" is ``loaded.prompt_template`` itself; "before" / "both" write ``question`` and a newline
    just before the first image placeholder, "before" leaving the template's text after the images
    empty. The placeholders are the template's own (same count, same order). Without images the
    question has one place: every order gives the template.
    """
    if order not in QUESTION_ORDERS:
        raise ValueError(f"question order must be one of {list(QUESTION_ORDERS)}, got {order!r}")
    if order == "after" or n_images == 0:
        return loaded.prompt_template(question, n_images)
    prompt = loaded.prompt_template(question if order == "both" else "", n_images)
    at = prompt.index(loaded.image_placeholder)
    return prompt[:at] + question + "\n" + prompt[at:]


def prompt_text(loaded, question: str, n_images: int, labels: str = "none", order: str = "after") -> str:
    """The model's formatted prompt for ``question`` about ``n_images`` pictures, labelled per
    ``labels``, the question placed per ``order`` (:func:`order_question`)."""
    return label_pictures(
        order_question(loaded, question, n_images, order), loaded.image_placeholder, n_images, labels
    )


def single(rng: np.random.Generator, split: str) -> Sample:
    """One object: what it is, its colour, its shape or where it is."""
    scene = random_scene(rng, split, 1)
    obj = scene.objects[0]
    options = [
        (WHAT, obj.name, "single"),
        (COLOUR_OF_SHAPE, obj.colour, "single-colour"),
        (SHAPE_OF, obj.shape, "single-shape"),
        (WHERE.format(name=obj.name), obj.position, "single-where"),
    ]
    question, answer, kind = options[rng.integers(len(options))]
    return Sample((scene,), question, answer, kind)


def two(rng: np.random.Generator, split: str) -> Sample:
    """Two different objects: the caption, one side, a relation, or a colour by shape."""
    scene = random_scene(rng, split, 2)
    left, right = scene.objects
    options = [
        (WHAT, scene.caption, "two"),
        (ON_THE.format(position="left"), left.name, "two-side"),
        (ON_THE.format(position="right"), right.name, "two-side"),
        (LEFT_OF.format(name=right.name), left.name, "two-relation"),
    ]
    if left.shape != right.shape:
        target = (left, right)[rng.integers(2)]
        options.append((COLOUR_OF.format(shape=target.shape), target.colour, "two-colour"))
    question, answer, kind = options[rng.integers(len(options))]
    return Sample((scene,), question, answer, kind)


def count(rng: np.random.Generator, split: str) -> Sample:
    """1–3 objects of one pair: how many, or the counted caption."""
    n = int(rng.integers(1, 4))
    scene = random_scene(rng, split, n, same=True)
    shape = scene.objects[0].shape
    if rng.random() < 0.5:
        return Sample((scene,), HOW_MANY.format(shapes=plural(shape)), NUMBERS[n], "count")
    caption = scene.caption if n > 1 else scene.objects[0].name
    return Sample((scene,), WHAT, caption, "count-caption")


def nth(rng: np.random.Generator, split: str, n_images: int) -> Sample:
    """``n_images`` single-object pictures; the colour, or the object, in one of them."""
    scenes = tuple(random_scene(rng, split, 1) for _ in range(n_images))
    k = int(rng.integers(n_images))
    obj = scenes[k].objects[0]
    if rng.random() < 0.5:
        return Sample(scenes, NTH_COLOUR.format(ordinal=ORDINALS[k]), obj.colour, "nth-colour")
    return Sample(scenes, NTH_WHAT.format(ordinal=ORDINALS[k]), obj.name, "nth-what")


def which(rng: np.random.Generator, split: str, n_images: int) -> Sample:
    """``n_images`` pictures; exactly one holds ``count`` shapes of one kind (2 or 3), the answer is its ordinal.

    The other pictures hold one object of any shape, or as many of another shape, so neither the
    shape alone nor the count alone finds the picture.
    """
    target_count = int(rng.integers(2, 4))
    shape = SHAPES[rng.integers(len(SHAPES))]
    k = int(rng.integers(n_images))
    scenes = []
    for i in range(n_images):
        if i == k:
            scenes.append(_of_shape(rng, split, shape, target_count))
        elif rng.random() < 0.5:
            scenes.append(random_scene(rng, split, 1))
        else:
            other = SHAPES[(SHAPES.index(shape) + 1 + rng.integers(len(SHAPES) - 1)) % len(SHAPES)]
            scenes.append(_of_shape(rng, split, other, target_count))
    question = WHICH_HAS.format(count=NUMBERS[target_count], shapes=plural(shape))
    return Sample(tuple(scenes), question, ORDINALS[k], "which")


def _of_shape(rng: np.random.Generator, split: str, shape: str, n: int) -> Scene:
    options = [p for p in pairs(split) if p[1] == shape]
    return random_scene(rng, split, n, same=True, pair=options[rng.integers(len(options))])


def _nth_few(rng: np.random.Generator, split: str) -> Sample:
    return nth(rng, split, int(rng.integers(2, 4)))


def _which_few(rng: np.random.Generator, split: str) -> Sample:
    return which(rng, split, int(rng.integers(2, 4)))


def _nth_wide(rng: np.random.Generator, split: str) -> Sample:
    return nth(rng, split, int(rng.integers(1, 6)))


def _which_wide(rng: np.random.Generator, split: str) -> Sample:
    return which(rng, split, int(rng.integers(1, 6)))


def single_what(rng: np.random.Generator, split: str) -> Sample:
    """One object, "What is in the image?" → its colour and shape (the short caption)."""
    scene = random_scene(rng, split, 1)
    return Sample((scene,), WHAT, scene.objects[0].name, "single")


def two_what(rng: np.random.Generator, split: str) -> Sample:
    """Two different objects, "What is in the image?" → ``"red star and blue circle"`` (left to right)."""
    scene = random_scene(rng, split, 2)
    return Sample((scene,), WHAT, scene.caption, "two")


def _as_turns(
    rng: np.random.Generator, scenes: tuple[Scene, ...], options: list, kind: str, k: int
) -> Sample:
    """``k`` of ``options`` ((question, answer) pairs) in random order: the first is the question.

    Questions that name an object ("Where is the red star?") go after those that do not, so the
    first answer is always read from the image, never copied from an earlier question.
    """
    picked = [options[i] for i in rng.permutation(len(options))[:k]]
    picked.sort(key=lambda qa: any(name in qa[0] for name in _names(scenes)))
    (question, answer), rest = picked[0], tuple(picked[1:])
    return Sample(scenes, question, answer, kind, rest)


def _names(scenes: tuple[Scene, ...]) -> set[str]:
    return {o.name for scene in scenes for o in scene.objects} | {
        o.shape for scene in scenes for o in scene.objects
    }


def single_turns(rng: np.random.Generator, split: str) -> Sample:
    """One object, asked what it is, its colour, its shape and where it is, in random order."""
    scene = random_scene(rng, split, 1)
    obj = scene.objects[0]
    options = [
        (WHAT, obj.name),
        (COLOUR_OF_SHAPE, obj.colour),
        (SHAPE_OF, obj.shape),
        (WHERE.format(name=obj.name), obj.position),
    ]
    return _as_turns(rng, (scene,), options, "single-turns", len(options))


def two_turns(rng: np.random.Generator, split: str) -> Sample:
    """Two different objects: the caption, both sides, the relation, colours by shape (4 of them)."""
    scene = random_scene(rng, split, 2)
    left, right = scene.objects
    options = [
        (WHAT, scene.caption),
        (ON_THE.format(position="left"), left.name),
        (ON_THE.format(position="right"), right.name),
        (LEFT_OF.format(name=right.name), left.name),
    ]
    if left.shape != right.shape:
        options += [(COLOUR_OF.format(shape=o.shape), o.colour) for o in (left, right)]
    return _as_turns(rng, (scene,), options, "two-turns", 4)


def two_sides(rng: np.random.Generator, split: str) -> Sample:
    """Two different objects, 4 side questions: what is on each side, and its colour or shape apart."""
    scene = random_scene(rng, split, 2)
    options = []
    for position, obj in zip(("left", "right"), scene.objects):  # objects run left to right
        options += [
            (ON_THE.format(position=position), obj.name),
            (COLOUR_ON.format(position=position), obj.colour),
            (SHAPE_ON.format(position=position), obj.shape),
        ]
    return _as_turns(rng, (scene,), options, "two-sides", 4)


def count_turns(rng: np.random.Generator, split: str) -> Sample:
    """1–3 objects of one pair: how many, and the counted caption."""
    n = int(rng.integers(1, 4))
    scene = random_scene(rng, split, n, same=True)
    shape = scene.objects[0].shape
    caption = scene.caption if n > 1 else scene.objects[0].name
    options = [(HOW_MANY.format(shapes=plural(shape)), NUMBERS[n]), (WHAT, caption)]
    return _as_turns(rng, (scene,), options, "count-turns", 2)


MAKERS: dict[str, Callable[[np.random.Generator, str], Sample]] = {
    "single-what": single_what,
    "single": single,
    "two-what": two_what,
    "two": two,
    "count": count,
    "nth": _nth_few,
    "which": _which_few,
    "nth-wide": _nth_wide,
    "which-wide": _which_wide,
    "single-turns": single_turns,
    "two-turns": two_turns,
    "two-sides": two_sides,
    "count-turns": count_turns,
}
# mix name -> kind -> weight. Multi-image samples cost 2-3 images' tokens, so they are kept rarer;
# "focused" leans on the one- and two-object questions the VQA targets are set on; "core" is the
# measured recipe's short caption of one object (shared/spec/projector-training.md) plus two-object
# questions, and nothing else; "turns" asks several questions per image (one image encoding, 2-4
# supervised answers); "spec" is the measured recipe alone (one object, its short name: the first
# phase of a curriculum, continued with --init-from on a richer mix); "mixed" is that second phase:
# the one-object caption kept at 40 % (so the first phase is not forgotten), the two-object caption
# and several questions per two-object image (the VQA set's "two" group); "mixed-nth" adds "the
# k-th of 2-3 pictures" questions, the multi-image prompt format; "mixed-multi" also asks "which of
# 2-3 pictures has two stars" (every question form of the VQA set), the second phase after the
# vision layer moved to DINOv2's middle layer (and "long", below).
MIXES: dict[str, dict[str, float]] = {
    "spec": {"single-what": 1.0},
    "full": {"single": 0.34, "two": 0.30, "count": 0.18, "nth": 0.10, "which": 0.08},
    "focused": {"single": 0.45, "two": 0.35, "count": 0.10, "nth": 0.05, "which": 0.05},
    "core": {"single-what": 0.5, "single": 0.1, "two": 0.4},
    "mixed": {"single-what": 0.4, "single-turns": 0.1, "two-what": 0.2, "two-turns": 0.3},
    "mixed-nth": {"single-what": 0.36, "single-turns": 0.09, "two-what": 0.18, "two-turns": 0.27, "nth": 0.1},
    "mixed-multi": {
        "single-what": 0.3,
        "single-turns": 0.1,
        "two-what": 0.15,
        "two-turns": 0.3,
        "nth": 0.1,
        "which": 0.05,
    },
    # "two-multi": "mixed-multi" with its several-picture questions over 1-5 pictures (the VQA set
    # asks about 1, 2, 5 and 10; one picture teaches "first" as an answer) and a fifth of the samples
    "two-multi": {
        "single-what": 0.25,
        "single-turns": 0.1,
        "two-what": 0.15,
        "two-turns": 0.3,
        "nth-wide": 0.12,
        "which-wide": 0.08,
    },
    # "long": the several-hundred-step run from the first phase's projector: one-object captions
    # kept at 30 %, one-object turns (colour and shape asked apart, so each word has its own answer)
    # 20 %, two-object captions and turns, and a few multi-picture prompts from the start
    "long": {
        "single-what": 0.3,
        "single-turns": 0.2,
        "two-what": 0.12,
        "two-turns": 0.25,
        "nth": 0.08,
        "which": 0.05,
    },
    # "pictures": half the samples ask about the k-th of (or which of) 2-3 pictures, to teach a
    # several-picture prompt format (e.g. --labels ordinal) from a trained projector; one- and
    # two-object samples keep the rest from being forgotten
    "pictures": {"single-what": 0.3, "two-turns": 0.2, "nth": 0.3, "which": 0.2},
    # "sides": "mixed" with the two-object captions replaced by side questions asked whole and by
    # attribute ("What colour is on the left?"), the kind the VQA set's misses are most often
    "sides": {"single-what": 0.4, "single-turns": 0.1, "two-sides": 0.3, "two-turns": 0.2},
    # "two-sides-multi": "two-multi" with a quarter of the samples asking each side's colour and shape
    # apart (two-sides): more two-object steps, each answer one word read from one object's tokens
    # (the colour-shape probe on the projector's output tokens reads held-out pairs at 0.92-0.98)
    "two-sides-multi": {
        "single-what": 0.2,
        "single-turns": 0.1,
        "two-what": 0.1,
        "two-turns": 0.2,
        "two-sides": 0.25,
        "nth-wide": 0.09,
        "which-wide": 0.06,
    },
    "turns": {"single-turns": 0.45, "two-turns": 0.35, "count-turns": 0.1, "nth": 0.05, "which": 0.05},
}


def training_sample(rng: np.random.Generator, split: str = "train", mix: str = "full") -> Sample:
    """One sample of a training mix (kind weights in :data:`MIXES`)."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {list(MIXES)}, got {mix!r}")
    weights = MIXES[mix]
    names = list(weights)
    p = np.array([weights[n] for n in names])
    name = names[rng.choice(len(names), p=p / p.sum())]
    return MAKERS[name](rng, split)
