"""Every policy that became a score keeps exactly the entries it kept before (digests frozen in
``kept_sets.json`` from the code before the refactor), and generates the same tokens."""

from __future__ import annotations

import json

import pytest

from tests.runtime.policies.kept_sets import MODELS, SPECS, TABLE, kept_digests, spec_id


@pytest.fixture(scope="module")
def frozen():
    return json.loads(TABLE.read_text())


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name,kw", SPECS, ids=[spec_id(n, kw) for n, kw in SPECS])
def test_kept_sets_equal_the_frozen_table(model, name, kw, engines, images, frozen):
    want = frozen[model][spec_id(name, kw)]
    got = kept_digests(engines[model], name, kw, images)
    for p, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["tokens"] == w["tokens"], (p, "tokens")
        assert len(g["states"]) == len(w["states"]), (p, "decode steps")
        for step, (gs, ws) in enumerate(zip(g["states"], w["states"])):
            diff = [i for i, (a, b) in enumerate(zip(gs, ws, strict=True)) if a != b]
            assert not diff, f"prompt {p}, state {step}: layers {diff} keep other entries"
