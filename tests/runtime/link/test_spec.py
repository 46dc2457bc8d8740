"""One name per linking method: what a request asks for and what a saved check measured read the same."""

from __future__ import annotations

from dataclasses import fields

import pytest

from vlkv.runtime.link.gate import LinkCheck
from vlkv.runtime.link.spec import LinkSpec, link_label


@pytest.mark.parametrize(
    ("spec", "label"),
    [
        (LinkSpec("mpic", 32), "mpic-32"),
        (LinkSpec("mpic", 16, pick="ramp"), "mpic-ramp-16"),
        (LinkSpec("cacheblend", r=0.15), "cacheblend-r0.15"),
        (LinkSpec("cacheblend", r=0.15, deviation="v"), "cacheblend-r0.15-v"),
        (LinkSpec("prefix"), "prefix"),
        (
            LinkSpec("full-reuse", store_budget=0.25, store_scorer="stride"),
            "full-reuse (records at 0.25, stride)",
        ),
        (LinkSpec("mpic", 8, store_rank=4), "mpic-8 (records at rank 4)"),
    ],
)
def test_a_spec_is_labelled_by_method_and_records(spec, label):
    assert spec.label == label


@pytest.mark.parametrize(
    "spec",
    [
        LinkSpec("mpic", 32),
        LinkSpec("mpic", 4, pick="ramp"),
        LinkSpec("cacheblend", r=0.5),
        LinkSpec("full-reuse"),
    ],
)
def test_a_saved_check_is_named_as_the_spec_it_measured(spec):
    values = {f.name: 0 for f in fields(LinkCheck)} | {"model": "m", "fingerprint": "f", "created": 0.0}
    r = spec.r if spec.method == "cacheblend" else None
    check = LinkCheck(
        **values | {"method": spec.method, "k": spec.k, "r": r, "pick": spec.pick, "store_budget": 1.0}
    )
    assert check.name == spec.label == link_label(spec.method, spec.k, r, spec.pick)
