"""The offline evaluation corpora: English paragraphs, image-QA prompts and real long prose.

Nothing here downloads anything. The paragraphs are original plain factual prose written for
this project (10 paragraphs of 150-200 words) and ship as package data in
``vlkv/eval/data/corpus_en.txt``, one paragraph per blank-line-separated block.

Long real prose for the continuation protocol (:mod:`vlkv.eval.continuation`) is the King James
Version of the Bible (1611, public domain), from Debian's ``bible-kjv`` package
(``apt-get install bible-kjv``), read through its ``bible`` command: narrative books only.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from importlib import resources

__all__ = ["CORPUS_FILE", "IMAGE_QA_PROMPTS", "KJV_BOOKS", "image_qa_prompts", "kjv_books", "paragraphs"]

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


# Narrative prose books of the KJV and their chapter counts (the `bible` command needs the range).
KJV_BOOKS: tuple[tuple[str, int], ...] = (
    ("Judges", 21),
    ("1Samuel", 31),
    ("2Samuel", 24),
    ("1Kings", 22),
    ("2Kings", 25),
    ("Nehemiah", 13),
    ("Acts", 28),
    ("Joshua", 24),
)
_VERSE_REF = re.compile(r"^\S+?\d+:\d+ ")


def kjv_books(books: tuple[tuple[str, int], ...] = KJV_BOOKS) -> list[tuple[str, str]]:
    """``[(f"kjv:{book}", text)]``: each book as plain prose, verse references stripped, one
    paragraph per chapter. Raises ``FileNotFoundError`` saying how to install the text."""
    exe = shutil.which("bible")
    if exe is None:
        raise FileNotFoundError("the KJV text needs Debian's bible-kjv package: apt-get install bible-kjv")
    out = []
    for book, chapters in books:
        raw = subprocess.run(
            [exe, "-f", f"{book}1:1-{chapters}:999"], capture_output=True, text=True, check=True
        ).stdout
        paras, current, chapter = [], [], None
        for line in raw.splitlines():
            m = _VERSE_REF.match(line)
            if not m:
                continue
            ch = m.group(0).rsplit(":", 1)[0]
            if ch != chapter and current:
                paras.append(" ".join(current))
                current = []
            chapter = ch
            current.append(line[m.end() :].strip())
        paras.append(" ".join(current))
        out.append((f"kjv:{book}", "\n\n".join(paras)))
    return out
