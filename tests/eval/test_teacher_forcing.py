"""Teacher-forced quality vs the full cache: budget 1.0 is exactly full, compression is measurable."""

from __future__ import annotations

import pytest

from vlkv.eval.teacher_forcing import compare_to_full, forced_logits
from vlkv.runtime.policies import POLICIES, make_policy
from vlkv.runtime.prompt import Prompt


@pytest.fixture(scope="module")
def prompts(images):
    return [
        Prompt("Describe this.", [images[0]]),
        Prompt("Compare the two pictures.", [images[1], images[2]]),
    ]


# attnpack compresses by rank, not budget: its lossless case (full rank) is tested in test_attnpack
@pytest.mark.parametrize(
    "policy", sorted(n for n, c in POLICIES.items() if n != "full" and c.exact_at_full_budget)
)
def test_budget_one_has_full_ppl_and_zero_kl(policy, engines, prompts):
    report = compare_to_full(engines["tiny-llava"], prompts, make_policy(policy, budget=1.0), new_tokens=6)
    assert report.ppl == report.full_ppl
    assert report.kl_mean == 0.0
    assert report.top1_agreement == 1.0 and report.rouge_l == 1.0


def test_compression_changes_the_forced_distribution(engines, prompts):
    report = compare_to_full(engines["tiny-llava"], prompts, make_policy("elastic", budget=0.2), new_tokens=6)
    assert report.kl_mean > 0 and report.ppl != report.full_ppl


def test_forced_logits_follow_reference_lengths(engines, prompts):
    refs = [[5, 6, 7], [8, 9]]
    out = forced_logits(engines["tiny-qwen2-vl"], prompts, make_policy("h2o", budget=0.5), refs)
    assert [o.shape[0] for o in out] == [3, 2]
