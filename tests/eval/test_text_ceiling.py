"""The LM's text ceiling on the two-object questions: prompts, scoring, and a run on a tiny model."""

from __future__ import annotations

import json

import pytest

from vlkv.eval import text_ceiling as tc
from vlkv.eval.scenes import COLOURS, SHAPES


def test_each_form_says_what_it_claims_and_puts_the_question_last():
    caption = tc.prompt_text("caption", "red star", "blue circle", "What is on the left?")
    sides = tc.prompt_text("sides", "red star", "blue circle", "What is on the left?")
    swapped = tc.prompt_text("sides-swapped", "red star", "blue circle", "What is on the left?")
    for text in (caption, sides, swapped):
        assert text.endswith("Q: What is on the left? A:")
        assert text.count("\n") == len(tc.EXAMPLES)  # one example per line, the item last
    last = [t.splitlines()[-1] for t in (caption, sides, swapped)]
    assert "left" not in last[0].split("Q:")[0]  # the caption form gives no positions
    assert "a red star on the left and a blue circle on the right" in last[1]
    assert last[2].index("blue circle on the right") < last[2].index("red star on the left")


def test_the_examples_share_no_word_with_the_scenes():
    """No answer can be copied from an example: their colours and shapes are not the scenes'."""
    words = {w for left, right, *_ in tc.EXAMPLES for name in (left, right) for w in name.split()}
    assert not words & (set(COLOURS) | set(SHAPES))


def test_the_answer_is_cut_at_the_first_line_break():
    assert tc.score(" Red star\nThe image shows", "red star") == ("red star", True)
    assert tc.score("red star and blue circle\n", "red star") == ("red star and blue circle", False)


def test_a_bad_form_is_named():
    with pytest.raises(ValueError, match="form must be one of"):
        tc.prompt_text("aside", "red star", "blue circle", "What is on the left?")


def test_a_run_answers_every_item_under_every_form(engines):
    rows = tc.evaluate(engines["tiny-llava"], ["caption", "sides"], draws=[0, 1], n_two=3, batch=4)
    assert len(rows) == 2 * 2 * 3
    assert {r["form"] for r in rows} == {"caption", "sides"} and {r["draw"] for r in rows} == {0, 1}
    assert all(r["kind"].startswith("two") and r["expected"] for r in rows)
    # each form asks the same items: the same questions in the same order
    by_form = [[r["question"] for r in rows if r["form"] == f] for f in ("caption", "sides")]
    assert by_form[0] == by_form[1]
    table = tc.summary(rows)
    assert table.splitlines()[2].startswith("| caption | ") and "/ 6 |" in table


def test_the_command_writes_every_answer(tmp_path):
    out = tmp_path / "tc.json"
    assert (
        tc.main(
            ["--model", "tiny-llava", "--draws", "0", "--n-two", "2", "--forms", "sides", "--out", str(out)]
        )
        == 0
    )
    got = json.loads(out.read_text())
    assert got["model"] == "tiny-llava" and len(got["rows"]) == 2
    assert out.with_suffix(".md").read_text().startswith("| form | all |")


def test_the_items_are_the_vqa_draws_own():
    """The same two-object items as ``vlkv.eval.vqa``'s draw (its one-object items drawn first)."""
    from vlkv.eval.vqa import build_set

    class Echo:  # answers "x" to every prompt: only which items are asked matters here
        def generate(self, prompts, policy, max_new_tokens):
            from types import SimpleNamespace

            return SimpleNamespace(samples=[SimpleNamespace(text="x") for _ in prompts])

    rows = tc.evaluate(Echo(), ["sides"], draws=[2], n_two=5, n_single=7)
    want = [
        i.sample.question
        for i in build_set(n_single=7, n_two=5, n_multi=0, counts=(), seed=2)
        if i.group == "two"
    ]
    assert [r["question"] for r in rows] == want and len(want) == 5
