"""Stage 2's keep-text term: plain text the LM adapters must leave as the base language model had it.

Stage 2 run A (``docs/benchmarks/2026-11-27-stage2-cpu-x86_64/``) taught the adapters the scene
questions, and the folded adapters then answered "The capital of France is" with ``France`` and raised
prose perplexity 17.9 -> 19.8: nothing in its mix was ordinary text. ``scripts/train_projector.py
--keep-text W`` therefore adds, each step, ``W x KL(base LM || adapted LM)`` over the next-token
distributions of a few plain-text items, the base being the same model with its adapters switched off
(:func:`vlkv.runtime.models.lm_lora.disabled`: no second copy, no gradient through it). Text items
reach only the adapters (no image tokens), so the projector is untouched by this term.

Items (:func:`items`): chat turns (a factual question in the model's chat template and a short reply;
the reply only places positions to compare: the targets are the base model's distributions, never
these words) and prose (two consecutive sentences of the bundled corpus, :mod:`vlkv.eval.corpus`).
The checks the term is meant to pass are kept out: no question about a capital city, and the
corpus's lighthouse paragraph is left out (the perplexity check reads another lighthouse text,
``tests/runtime/models/test_smollm2_llava.py``'s ``PARAGRAPH``).
"""

from __future__ import annotations

import re
from functools import cache

import numpy as np
import torch
from torch import Tensor

from vlkv.eval import corpus
from vlkv.eval.text_scenes import distill_kl
from vlkv.runtime.models import lm_lora

# the keep-text draws' own stream beside a step's batch ([seed, step]) and text-form draws
# ([seed, step, 11]): a run with --keep-text 0 draws nothing, and its batches are those drawn before
_STREAM = 13

# (question, a short reply): general knowledge; no capitals, so the Paris check ("The capital of
# France is") stays a held-out prompt rather than a near copy of a trained one
CHAT: tuple[tuple[str, str], ...] = (
    ("What is the largest planet in the solar system?", "Jupiter is the largest planet in the solar system."),
    ("What is the longest river in Africa?", "The Nile is the longest river in Africa."),
    ("How many days are there in a week?", "There are seven days in a week."),
    ("What do bees make?", "Bees make honey and wax."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("What is the boiling point of water at sea level?", "Water boils at 100 degrees Celsius at sea level."),
    ("Which animal is known as the king of the jungle?", "The lion is known as the king of the jungle."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What gas do plants take in from the air?", "Plants take in carbon dioxide from the air."),
    ("What is the tallest mountain on Earth?", "Mount Everest is the tallest mountain on Earth."),
    ("Can you suggest a name for a small bakery?", 'How about "The Morning Loaf"?'),
    ("What is two plus three?", "Two plus three is five."),
    ("Which ocean is the largest?", "The Pacific Ocean is the largest ocean."),
    ("What colour is the sky on a clear day?", "The sky is blue on a clear day."),
    ("Write one sentence about autumn.", "In autumn the leaves turn gold and red and fall from the trees."),
    ("What is the freezing point of water?", "Water freezes at 0 degrees Celsius."),
)
KINDS = ("chat", "prose")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


@cache
def prose() -> tuple[str, ...]:
    """The corpus's paragraphs (the lighthouse one left out) as items of two consecutive sentences."""
    out = []
    for para in corpus.paragraphs():
        if "lighthouse" in para.lower():
            continue
        sentences = _SENTENCE.split(" ".join(para.split()))
        out += [" ".join(sentences[i : i + 2]) for i in range(0, len(sentences) - 1, 2)]
    return tuple(out)


def chat_text(loaded, question: str, reply: str) -> str:
    """One chat turn as the model sees it: the template's prompt, the reply, the end of turn."""
    return loaded.prompt_template(question, 0) + reply + loaded.processor.tokenizer.eos_token


def items(loaded, seed: int, step: int, n: int) -> list[str]:
    """Step ``step``'s ``n`` keep-text items: chat turns and prose in turn (a chat turn first), each drawn
    with replacement on the stream ``[seed, step, 13]`` (the same on a resume)."""
    if n < 1:
        raise ValueError(f"keep-text items per step must be >= 1, got {n}")
    rng = np.random.default_rng([seed, step, _STREAM])
    texts = prose()
    out = []
    for k in range(n):
        if KINDS[k % 2] == "chat":
            out.append(chat_text(loaded, *CHAT[int(rng.integers(len(CHAT)))]))
        else:
            out.append(texts[int(rng.integers(len(texts)))])
    return out


def kl_to_base(loaded, text: str) -> Tensor:
    """Mean over ``text``'s positions of ``KL(base || adapted)`` of the next-token distributions: the
    base is the same model with its LM adapters off (no gradient), the adapted one carries the
    gradient to the adapters. A scalar; exactly 0 when every adapter's ``B`` is zero."""
    tok = loaded.processor.tokenizer
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]  # (1, T)
    model = loaded.model
    with torch.no_grad(), lm_lora.disabled(model):
        base = model(input_ids=ids, use_cache=False).logits[0].float()  # (T, vocab)
    adapted = model(input_ids=ids, use_cache=False).logits[0].float()
    return distill_kl(adapted, base, torch.ones(ids.shape[1], dtype=torch.bool))
