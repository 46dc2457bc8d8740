"""Tenancy of the in-pool records: one scheduler (one pool, one segment table) serves every tenant,
and no tenant links another's prefix or image record; the same tenant still does."""

from __future__ import annotations

from vlkv.runtime.link.linker import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler

TEXT = "A long shared system prompt that every tenant sends first, word for word. Then: hello?"


def _run(sched: Scheduler, prompt: Prompt, spec: LinkSpec, tenant: str) -> Request:
    req = Request(prompt, make_policy("full"), 2, stop_at_eos=False, link=spec, tenant=tenant)
    sched.submit(req)
    sched.run()
    assert req.error is None, req.error
    return req


def test_a_text_only_prefix_is_never_linked_across_tenants(engines):
    sched = Scheduler(engines["tiny-llava"], link_threshold=0.0)
    spec = LinkSpec("prefix")
    first = _run(sched, Prompt(TEXT), spec, "alice")
    assert first.link_stats.reused_tokens == 0
    bob = _run(sched, Prompt(TEXT), spec, "bob")
    assert (bob.link_stats.hits, bob.link_stats.reused_tokens) == (0, 0)
    again = _run(sched, Prompt(TEXT), spec, "alice")
    assert again.link_stats.hits == 1 and again.link_stats.reused_tokens == again.prompt_tokens - 1
    assert again.tokens == first.tokens == bob.tokens


def test_an_image_record_in_the_pool_is_never_linked_across_tenants(engines, images):
    sched = Scheduler(engines["tiny-llava"], link_threshold=0.0)
    for spec in (LinkSpec("mpic", 2), LinkSpec("prefix")):
        prompt = Prompt("What is this?", [images[2]])
        _run(sched, prompt, spec, "alice")
        bob = _run(sched, prompt, spec, "bob")
        assert (bob.link_stats.hits, bob.link_stats.reused_tokens) == (0, 0), spec
        again = _run(sched, prompt, spec, "alice")
        assert again.link_stats.hits == 1 and again.link_stats.reused_tokens > 0, spec
        sched.segments.release()
