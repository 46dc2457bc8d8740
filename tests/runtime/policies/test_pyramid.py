"""PyramidKV: SnapKV scoring under the pyramid allocator."""

from __future__ import annotations

import pytest

from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt


def test_pyramidkv_is_snapkv_with_the_pyramid_allocator(engines, images):
    engine = engines["tiny-llava"]
    prompts = [Prompt("What do you see?", [images[0]]), Prompt("Two pictures.", [images[1], images[2]])]
    a = engine.generate(prompts, make_policy("pyramidkv", budget=0.3, beta=5), max_new_tokens=4)
    b = engine.generate(
        prompts, make_policy("snapkv", budget=0.3, allocator="pyramid", allocator_beta=5), max_new_tokens=4
    )
    for x, y in zip(a.samples, b.samples):
        assert x.token_ids == y.token_ids and x.kept_per_layer == y.kept_per_layer
        kept = x.kept_per_layer
        assert all(p > q for p, q in zip(kept, kept[1:])), kept  # shallow layers keep more


@pytest.mark.parametrize(("kwargs", "field"), [(dict(beta=1.0), "beta"), (dict(floor=0.0), "floor")])
def test_pyramidkv_rejects_out_of_range(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_policy("pyramidkv", **kwargs)
