"""kv_deviation: a cache against itself deviates by 0; a fully reused cache against a full prefill of the
same prompt is exact at layer 0 (K/V there depend on the token alone; linked keys are rotated on read) and
deviates at the last layer on the stored images' rows, which miss the prompt before them."""

from __future__ import annotations

import torch

from vlkv.runtime.link.deviation import kv_deviation
from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.records import RecordSource
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt


def test_deviation_is_zero_for_itself_and_grows_past_layer_zero_for_linked_rows(engines, images):
    engine = engines["tiny-llava"]
    prompt = Prompt("Now in this order: which is brighter?", [images[0], images[1]])
    batch = engine.encode([prompt])
    n = int(batch.lengths[0])
    full = engine.new_cache(batch)
    engine.prefill(batch, make_policy("full"), full)
    dk, dv = kv_deviation(full, full, n)
    assert dk.shape == dv.shape == (len(full.layers), n)
    assert float(dk.abs().max()) == 0.0 and float(dv.abs().max()) == 0.0
    store = SegmentStore(full.pool)
    source = RecordSource.for_engine(engine, store)
    first = Prompt("Look.", [images[1], images[0]])
    b1 = engine.encode([first])
    link_prefill(
        engine, b1, first.images, engine.new_cache(b1, pool=store.pool), LinkSpec("full-reuse"), source
    )
    linked = engine.new_cache(batch, pool=store.pool)
    _, stats = link_prefill(engine, batch, prompt.images, linked, LinkSpec("full-reuse"), source)
    assert stats.hits == 2
    dk, dv = kv_deviation(linked, full, n)
    a, b = batch.spans[0].image_spans[1]  # the second image: its record never saw the first one
    torch.testing.assert_close(dk[0], torch.zeros(n), rtol=0, atol=1e-8)
    torch.testing.assert_close(dv[0], torch.zeros(n), rtol=0, atol=1e-8)
    assert float(dk[-1, a:b].mean()) > 1e-6 and float(dv[-1, a:b].mean()) > 1e-6
