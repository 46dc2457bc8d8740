"""Stage 2's text samples: a scene told in a sentence instead of shown, and the image-to-text distillation loss.

With the language model frozen, ``smollm2-llava`` answers two-object questions no better from a perfect
sentence than from the image (``docs/benchmarks/2026-11-27-text-ceiling-cpu-x86_64/``); rank-8 adapters
trained on such sentences learn the questions within minutes. ``scripts/train_projector.py --text-mix F``
therefore asks a fraction ``F`` of each batch's samples about a *description* of the sample's scenes
(same question, same answer, no image), so the adapters learn the reasoning from text while the
projector and the adapters learn, from the image samples, to read the same facts from image tokens.
``--distill W`` adds, for each image sample, ``W x KL(text || image)`` over the answer tokens: the same
model (no gradient) given the description is the teacher of the model given the image.
``--distill-hidden W`` matches, for each image sample, every layer's hidden states over the tokens both
prompts end with (the question and the answers: what the LM has gathered about the scene by then) to
the teacher's, a signal over every layer and position rather than the answer tokens alone.

Forms (:data:`FORMS`): ``caption`` names the objects left to right ("The image shows a red star and a
blue circle.", as the training captions do); ``sides`` adds where each is ("... a red star on the left
and a blue circle on the right."). Several pictures: "The first picture shows ... The second picture
shows ...".
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from vlkv.eval.scenes import ORDINALS, Scene

FORMS = ("caption", "sides")
# the text-sample draws' own stream beside a step's batch draw (which takes [seed, step]), so a run
# with --text-mix 0 draws the very batches it drew before the option existed
_STREAM = 11


def _article(words: str) -> str:
    return ("an " if words[0] in "aeiou" else "a ") + words


def _where(position: str) -> str:
    return "in the middle" if position == "middle" else f"on the {position}"


def describe_scene(scene: Scene, form: str) -> str:
    """One scene as a sentence: ``"The image shows a red star on the left and a blue circle on the right."``.

    A counting scene (several objects of one pair) is ``"two red stars"`` in both forms: its objects'
    places are not what its questions ask.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {list(FORMS)}, got {form!r}")
    if scene.same:
        what = scene.caption
    else:
        names = [
            _article(o.name) + (" " + _where(o.position) if form == "sides" else "") for o in scene.objects
        ]
        what = " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"The image shows {what}."


def describe(scenes: tuple[Scene, ...], form: str) -> str:
    """``scenes`` (one sample's pictures, in prompt order) as text: one scene as :func:`describe_scene`,
    several as one sentence per picture, ``"The second picture shows two blue circles."``."""
    if len(scenes) == 1:
        return describe_scene(scenes[0], form)
    if len(scenes) > len(ORDINALS):
        raise ValueError(f"descriptions go up to {len(ORDINALS)} pictures, got {len(scenes)}")
    told = [
        describe_scene(s, form).replace("The image", f"The {ORDINALS[k]} picture")
        for k, s in enumerate(scenes)
    ]
    return " ".join(told)


def text_prompt(loaded, scenes: tuple[Scene, ...], question: str, form: str) -> str:
    """The model's chat prompt, no image placeholder: the description, then the question."""
    return loaded.prompt_template(f"{describe(scenes, form)} {question}", 0)


def draw_forms(seed: int, step: int, batch: int, fraction: float) -> list[tuple[bool, str]]:
    """Per sample of step ``step``'s batch: (asked as text?, the description's form). The form is
    drawn for every sample (a distillation teacher needs one for image samples too); the draw
    depends only on ``(seed, step)``, so a resumed run draws the same."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"text fraction must be in [0, 1], got {fraction}")
    rng = np.random.default_rng([seed, step, _STREAM])
    return [(bool(rng.random() < fraction), FORMS[int(rng.integers(len(FORMS)))]) for _ in range(batch)]


def distill_kl(student: Tensor, teacher: Tensor, mask: Tensor) -> Tensor:
    """Mean over the positions in ``mask`` of ``KL(teacher || student)`` of the next-token distributions.

    ``student``, ``teacher``: logits ``(positions, vocab)`` at the same answer positions (the teacher's
    without gradient); ``mask``: ``(positions,)`` bool, the positions that predict answer tokens.
    """
    if student.shape != teacher.shape or mask.shape != student.shape[:1]:
        raise ValueError(
            f"logits {tuple(student.shape)} / {tuple(teacher.shape)} and mask {tuple(mask.shape)} differ"
        )
    if not mask.any():
        return student.sum() * 0.0
    log_s = torch.log_softmax(student[mask].float(), dim=-1)
    log_t = torch.log_softmax(teacher[mask].float(), dim=-1)
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean()


def common_suffix(a: Tensor, b: Tensor) -> int:
    """How many tokens the id sequences ``a`` ``(T_a,)`` and ``b`` ``(T_b,)`` end with in common."""
    n = min(len(a), len(b))
    same = (a[len(a) - n :] == b[len(b) - n :]).flip(0)
    return n if bool(same.all()) else int((~same).int().argmax())


def hidden_match(student: tuple[Tensor, ...], teacher: tuple[Tensor, ...], n: int) -> Tensor:
    """Mean over layers of ``|h_s - h_t|^2 / |h_t|^2`` over the last ``n`` positions.

    ``student``, ``teacher``: one ``(1, T, d)`` tensor per layer (embeddings first, as the model's
    ``hidden_states``; their ``T`` may differ: only the last ``n`` positions, the tokens both prompts
    end with, are compared). The embedding layer is skipped (the same tokens embed the same).
    """
    if len(student) != len(teacher):
        raise ValueError(f"{len(student)} student layers against {len(teacher)} teacher layers")
    if n < 1:
        return student[-1].sum() * 0.0
    terms = []
    for s, t in zip(student[1:], teacher[1:]):
        s, t = s[0, -n:].float(), t[0, -n:].float()
        terms.append((s - t).pow(2).sum() / t.pow(2).sum().clamp_min(1e-12))
    return torch.stack(terms).mean()
