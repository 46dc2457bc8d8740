"""Answer-word corruption for teacher-forced training (#29): the next answer word must come from the image.

Teacher forcing feeds the true answer's words as input, so after "green" the LM can predict the shape
from the colour word (the colour–shape pairs seen in training) instead of from the image. With
probability ``p`` per answer, one of its colour or shape words that is followed by another answer word
is replaced *in the input* by another word of the same kind (another colour / shape); the targets stay
the clean answer's tokens, so the word after it can only be predicted by reading the image (or the
description, for text-form samples).

Token alignment: the answer is tokenised word by word (the first word bare, the rest with their
leading space, then the end of turn), which is how the byte-level BPE splits the whole answer anyway
(checked on every corrupted reply). A replacement may have another token count than the word it
replaces; the slot of its first token keeps the clean word's first token as target (predicted from the
clean words before it), its other slots are not supervised (-100), and the slot after it keeps the clean
next token — the prediction the corruption is for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlkv.eval.scenes import COLOURS, SHAPES

IGNORE = -100
_STREAM = 43  # the corruption's own random stream: the batches and text forms draw what they drew


@dataclass(frozen=True)
class Swap:
    """Replace word ``word`` (0-based, split on spaces) of answer ``reply`` (0 = the first answer, then
    the follow-up turns' answers in order) by ``new`` in the teacher-forced input."""

    reply: int
    word: int
    new: str

    def __post_init__(self) -> None:
        if self.reply < 0 or self.word < 0:
            raise ValueError(f"reply and word must be >= 0, got {self.reply}, {self.word}")
        if self.new not in COLOURS and self.new not in SHAPES:
            raise ValueError(f"new must be a colour or shape word, got {self.new!r}")


def corruptible(answer: str) -> list[int]:
    """Indices of ``answer``'s colour / shape words that another answer word follows."""
    words = answer.split()
    return [i for i, w in enumerate(words[:-1]) if w in COLOURS or w in SHAPES]


def draw(rng: np.random.Generator, answers: list[str], p: float) -> tuple[Swap, ...]:
    """At most one swap per answer, each with probability ``p`` (answers with no corruptible word
    draw nothing). The replacement is uniform over the other words of the same kind."""
    swaps = []
    for r, answer in enumerate(answers):
        spots = corruptible(answer)
        if not spots or rng.random() >= p:
            continue
        i = spots[int(rng.integers(len(spots)))]
        word = answer.split()[i]
        pool = [w for w in (COLOURS if word in COLOURS else SHAPES) if w != word]
        swaps.append(Swap(r, i, pool[int(rng.integers(len(pool)))]))
    return tuple(swaps)


def answers(sample) -> list[str]:
    """A :class:`vlkv.eval.scene_tasks.Sample`'s answers in turn order (the first, then the follow-ups')."""
    return [sample.answer] + [a for _, a in sample.turns]


def draws(seed: int, step: int, answers: list[list[str]], p: float) -> list[tuple[Swap, ...]]:
    """The swaps of one step's samples (``answers[b]``: sample ``b``'s answers in turn order), drawn from
    ``(seed, step)`` on a stream of their own; ``p == 0`` draws nothing (no swaps)."""
    if not 0 <= p <= 1:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if p == 0:
        return [() for _ in answers]
    rng = np.random.default_rng([seed, step, _STREAM])
    return [draw(rng, a, p) for a in answers]


def reply_tokens(tok, answer: str, end: str, swap: Swap | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The answer's reply (answer + ``end``) as input ids ``(1, n)`` and per-slot targets ``(n,)``.

    Without ``swap``: the whole reply tokenised at once, targets equal to the inputs (today's tokens).
    With one: inputs carry the replacement word, targets the clean tokens as the module docstring says.
    """

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    if swap is None:
        whole = torch.tensor([ids(answer + end)])
        return whole, whole[0].clone()
    words = answer.split()
    if not swap.word < len(words) - 1:
        raise ValueError(f"swap word {swap.word} is not followed by another word in {answer!r}")
    pieces = [ids(w if j == 0 else " " + w) for j, w in enumerate(words)] + [ids(end)]
    if sum(pieces, []) != ids(answer + end):
        raise ValueError(f"{answer!r} does not tokenise word by word; cannot corrupt one word")
    inputs, targets = [], []
    for j, piece in enumerate(pieces):
        if j == swap.word:
            new = ids(swap.new if j == 0 else " " + swap.new)
            inputs += new
            targets += [piece[0]] + [IGNORE] * (len(new) - 1)
        else:
            inputs += piece
            targets += piece
    return torch.tensor([inputs]), torch.tensor(targets)


def answer_tokens(
    loaded, sample, swaps: tuple[Swap, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What follows ``sample``'s prompt in training: its answer, then each follow-up turn's user turn
    (as the chat template writes it after an end of turn) and answer, every answer ended by the end of
    turn and tokenised on its own, as generation would produce it.

    Returns input ids ``(1, n)``, the answer mask ``(n,)`` (True on answer tokens and their ends of
    turn) and per-slot targets ``(n,)`` (the clean tokens; equal to the inputs without ``swaps``).
    """
    tok = loaded.processor.tokenizer
    by_reply = {s.reply: s for s in swaps}
    ids, mask, targets = [], [], []
    for i, (question, answer) in enumerate(((sample.question, sample.answer), *sample.turns)):
        if i:
            turn = torch.tensor(
                tok("\n" + loaded.prompt_template(question, 0), add_special_tokens=False)["input_ids"]
            )
            ids.append(turn)
            targets.append(turn)
            mask.append(torch.zeros(len(turn), dtype=torch.bool))
        reply, target = reply_tokens(tok, answer, tok.eos_token, by_reply.get(i))
        ids.append(reply[0])
        targets.append(target)
        mask.append(torch.ones(len(target), dtype=torch.bool))
    return torch.cat(ids)[None], torch.cat(mask), torch.cat(targets)
