"""Generation with the full cache (and any policy at budget 1.0) equals transformers' own generate."""

from __future__ import annotations

import pytest

from tests.conftest import TINY
from vlkv.runtime.policies import POLICIES, make_policy
from vlkv.runtime.prompt import Prompt

NEW = 8


def _prompts(images):
    # different lengths and image counts (1, 2, 0) in one padded batch
    return [
        Prompt("Describe the picture.", [images[0]]),
        Prompt("What differs between these two?", [images[1], images[2]]),
        Prompt("Write a short poem about caches."),
    ]


def _hf_tokens(loaded, prompt: Prompt) -> list[int]:
    text = loaded.prompt_template(prompt.text, len(prompt.images))
    kwargs = {"text": [text], "return_tensors": "pt"}
    if prompt.images:
        kwargs["images"] = prompt.images
    inputs = loaded.processor(**kwargs)
    out = loaded.model.generate(
        **inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("name", TINY)
def test_full_matches_hf_generate_batch_and_single(name, engines, reference_models, images):
    prompts = _prompts(images)
    expected = [_hf_tokens(reference_models[name], p) for p in prompts]
    engine = engines[name]
    # HF was told not to stop either
    batch = engine.generate(prompts, make_policy("full"), NEW, stop_at_eos=False)
    assert [s.token_ids for s in batch.samples] == expected
    single = engine.generate(prompts[:1], make_policy("full"), NEW, stop_at_eos=False)
    assert single.samples[0].token_ids == expected[0]


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
# attnpack compresses by rank, not budget: its lossless case (full rank) is tested in test_attnpack
@pytest.mark.parametrize(
    "policy", sorted(n for n, c in POLICIES.items() if n != "full" and c.exact_at_full_budget)
)
def test_budget_one_is_exactly_full(name, policy, engines, images):
    engine = engines[name]
    prompts = _prompts(images)
    full = engine.generate(prompts, make_policy("full"), NEW, stop_at_eos=False)
    same = engine.generate(prompts, make_policy(policy, budget=1.0), NEW, stop_at_eos=False)
    assert [s.token_ids for s in same.samples] == [s.token_ids for s in full.samples]
    assert same.kv_bytes_used == full.kv_bytes_used
