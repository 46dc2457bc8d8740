"""Every policy that became a score keeps exactly the entries it kept before, at every decode step,
and generates the same tokens: the new selection against the pre-refactor code
(``pre_score.py``) on the same engine, so both see the same statistics.

Before the refactor the same digests were also frozen from the old code and compared (commit
16be1f7); an in-process reference stays valid when attention numerics change elsewhere."""

from __future__ import annotations

import pytest

from tests.runtime.policies.kept_sets import MODELS, SPECS, kept_digests, spec_id
from tests.runtime.policies.pre_score import PRE_SCORE
from vlkv.runtime.policies import registry


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name,kw", SPECS, ids=[spec_id(n, kw) for n, kw in SPECS])
def test_kept_sets_equal_the_pre_refactor_selection(model, name, kw, engines, images, monkeypatch):
    got = kept_digests(engines[model], name, kw, images)
    for key, cls in PRE_SCORE.items():
        monkeypatch.setitem(registry.POLICIES, key, cls)
    want = kept_digests(engines[model], name, kw, images)
    for p, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["tokens"] == w["tokens"], (p, "tokens")
        assert len(g["states"]) == len(w["states"]) == 5, (p, "decode steps")
        for step, (gs, ws) in enumerate(zip(g["states"], w["states"])):
            diff = [i for i, (a, b) in enumerate(zip(gs, ws, strict=True)) if a != b]
            assert not diff, f"prompt {p}, state {step}: layers {diff} keep other entries"


def test_the_reference_really_is_the_old_code(monkeypatch):
    """The swap takes: make_policy then builds the reference classes, wrappers included."""
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.policies.scorer import ScorePolicy

    for key, cls in PRE_SCORE.items():
        monkeypatch.setitem(registry.POLICIES, key, cls)
    assert type(make_policy("snapkv", budget=0.4, allocator="pyramid").scorer) is PRE_SCORE["snapkv"]
    assert type(make_policy("h2o", budget=0.4, evict_every=3).inner) is PRE_SCORE["h2o"]
    for cls in PRE_SCORE.values():
        assert cls.after_prefill is not ScorePolicy.after_prefill
