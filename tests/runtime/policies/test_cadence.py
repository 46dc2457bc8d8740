"""Decode cadence: eviction every N steps, statistics every step, N = 1 == the plain policy."""

from __future__ import annotations

import pytest

from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt


@pytest.mark.parametrize("name", ["h2o", "local"])
def test_every_one_is_the_plain_policy(name, engines, images):
    engine = engines["tiny-llava"]
    prompts = [Prompt("Describe it.", [images[0]]), Prompt("What is here, and why?", [images[1]])]
    plain = engine.generate(prompts, make_policy(name, budget=0.3), 8, stop_at_eos=False)
    wrapped = engine.generate(prompts, make_policy(name, budget=0.3, evict_every=1), 8, stop_at_eos=False)
    assert wrapped.policy == name
    for a, b in zip(plain.samples, wrapped.samples):
        assert a.token_ids == b.token_ids and a.kept_per_layer == b.kept_per_layer


def _held_score(layer) -> float:
    """H2O's accumulated attention summed over the layer's entries (columns past its length are room
    for appends: their content is not an entry's)."""
    n = int(layer.lengths.max())
    return float(layer.scores["h2o"][:, :, :n].sum())


@pytest.mark.parametrize("spec", [("h2o", {}), ("local", {}), ("h2o", {"allocator": "pyramid"})])
def test_eviction_runs_every_n_steps_and_statistics_every_step(spec, engines, images):
    name, extra = spec
    engine = engines["tiny-llava"]
    every = 3
    batch = engine.encode([Prompt("Describe the picture.", [images[2]])])
    pol = make_policy(name, budget=0.3, evict_every=every, **extra)
    ref = make_policy(name, budget=0.3, **extra)
    cache, ref_cache = engine.new_cache(batch), engine.new_cache(batch)
    out = engine.prefill(batch, pol, cache)
    engine.prefill(batch, ref, ref_cache)
    token = out.logits.argmax(-1)
    observed = name == "h2o" and not extra
    for step in range(1, 10):
        before = cache.lengths().clone()
        score = _held_score(cache.layers[0]) if observed else 0.0
        out = engine.decode(token, batch, pol, cache, step)
        after = cache.lengths()
        if step % every:
            assert (after == before + 1).all()  # no edit: only the new token
            if observed:  # the step's attention was still folded in: one softmax row per query head
                gained = _held_score(cache.layers[0]) - score
                assert gained == pytest.approx(engine.backend.num_heads, rel=1e-5)
        else:
            target = ref.decode_target(cache)
            if not extra:
                assert (after <= target).all()  # the surplus goes at once
            assert (after < before + 1).any()
        token = out.logits.argmax(-1)


def test_cadence_refuses_policies_it_cannot_defer():
    with pytest.raises(ValueError, match="unknown setting"):
        make_policy("snapkv", budget=0.3, evict_every=2)
    with pytest.raises(ValueError, match="evict_every must be an integer >= 1, got 0"):
        make_policy("h2o", budget=0.3, evict_every=0)
