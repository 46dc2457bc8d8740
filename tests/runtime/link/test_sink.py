"""Image records are computed after the template's opening (the attention sink), so an image linked
where a real prompt has it — right after that opening — is the same K/V as recomputing the prompt.

Before: records were computed from position 0 with nothing before them; the image's first token
became the sequence's attention sink and every entry differed (on the trained ``smollm2-llava``,
full reuse of one picture at the same position agreed 0.80 top-1 with full recompute).
"""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.records import RecordSource
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.sink import sink_ids
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.store import ContextStore

MODELS = ["tiny-llava", "tiny-qwen2-vl"]


def _linked_logits(engine, prompt, spec, store_dir):
    batch = engine.encode([prompt])
    pool = engine.new_cache(batch).pool
    source = RecordSource.for_engine(engine, SegmentStore(pool), ContextStore.open(store_dir, host_bytes=0))
    out, stats = link_prefill(engine, batch, prompt.images, engine.new_cache(batch, pool=pool), spec, source)
    return out.logits, stats


@pytest.mark.parametrize("name", MODELS)
def test_the_sink_is_what_the_template_puts_before_the_first_image(name, engines, images):
    engine = engines[name]
    ids = sink_ids(engine)
    batch = engine.encode([Prompt("What is it?", [images[0]])])
    a, _ = batch.spans[0].image_spans[0]
    assert len(ids) > 0 and batch.input_ids[0, :a].tolist() == ids
    assert sink_ids(engine) is ids  # once per engine


@pytest.mark.parametrize("name", MODELS)
def test_an_image_linked_after_the_opening_equals_recomputing_the_prompt(name, engines, images, tmp_path):
    engine = engines[name]
    spec = LinkSpec("full-reuse")
    _linked_logits(engine, Prompt("Look.", [images[1]]), spec, tmp_path)  # writes the record
    prompt = Prompt("And what colour is it?", [images[1]])
    linked, stats = _linked_logits(engine, prompt, spec, tmp_path)
    assert stats.hits == 1 and stats.reused_tokens > 0
    batch = engine.encode([prompt])
    full = engine.prefill(batch, make_policy("full"), engine.new_cache(batch)).logits
    torch.testing.assert_close(linked, full, atol=1e-4, rtol=1e-4)


def test_records_made_after_another_opening_are_other_records(engines):
    engine = engines["tiny-llava"]
    source = RecordSource.for_engine(engine, SegmentStore(None))
    assert source.settings["sink"] == sink_ids(engine)
