"""The offline evaluation corpus: English paragraphs for perplexity and image-QA prompts.

Nothing here downloads anything. The paragraphs are original plain factual prose written for
this project (10 paragraphs of 150-200 words) and ship as package data in
``vlkv/eval/data/corpus_en.txt``, one paragraph per blank-line-separated block.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

__all__ = ["CORPUS_FILE", "IMAGE_QA_PROMPTS", "image_qa_prompts", "paragraphs"]

CORPUS_FILE = "data/corpus_en.txt"

# Open-ended prompts in the style of LLaVA-Description / MM-Vet: long answers, so a compressed
# cache has many decode steps in which to drift from the full-cache generation.
IMAGE_QA_PROMPTS: tuple[str, ...] = (
    "Describe this image in detail.",
    "What is happening in this image? Explain step by step.",
    "List every object you can see in this image and where it is.",
    "What text, if any, appears in this image? Transcribe it exactly.",
    "What colours dominate this image, and where do they appear?",
    "Write a short story inspired by this image.",
    "What might have happened just before this picture was taken?",
    "Is there anything unusual or surprising in this image? Explain why.",
)


@cache
def paragraphs() -> tuple[str, ...]:
    """All corpus paragraphs, in file order, each stripped and with internal newlines kept."""
    text = resources.files("vlkv.eval").joinpath(CORPUS_FILE).read_text(encoding="utf-8")
    return tuple(block.strip() for block in text.split("\n\n") if block.strip())


def image_qa_prompts(n: int | None = None) -> tuple[str, ...]:
    """The first ``n`` image-QA prompts (all of them when ``n`` is None), in a fixed order."""
    if n is not None and not 1 <= n <= len(IMAGE_QA_PROMPTS):
        raise ValueError(f"n must be in [1, {len(IMAGE_QA_PROMPTS)}], got {n}")
    return IMAGE_QA_PROMPTS if n is None else IMAGE_QA_PROMPTS[:n]
