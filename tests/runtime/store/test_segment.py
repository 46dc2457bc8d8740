"""A stored record loads into a tiny model's KV pool as a SharedSegment and links like the original."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_image
from tests.runtime.store.helpers import make_record
from vlkv.runtime.backend import StepInputs
from vlkv.runtime.cache import Modality
from vlkv.runtime.engine import Engine
from vlkv.runtime.kv.segments import SharedSegment
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.store import (
    ContextStore,
    DiskTier,
    HostTier,
    Identity,
    Record,
    image_content,
    model_fingerprint,
    processor_settings,
)


def _rows(engine, batch, lo: int, hi: int) -> StepInputs:
    emb = engine.backend.embed(batch)[:, lo:hi]
    return StepInputs(
        batch.input_ids[:, lo:hi],
        batch.positions[:, lo:hi],
        batch.modality[:, lo:hi],
        torch.tensor([hi - lo]),
        emb,
    )


@pytest.fixture(scope="module")
def engine(tiny_llava):
    return Engine(tiny_llava)


def test_a_stored_span_links_back_to_the_tokens_of_full_recompute(engine, tmp_path):
    image = make_image(7)
    prompt = Prompt("Describe the picture, then the colours.", [image])
    want = engine.generate([prompt], make_policy("full"), 6, stop_at_eos=False).samples[0].token_ids
    batch = engine.encode([prompt])
    n = int(batch.lengths[0])
    m = n - 5  # the image and most of the text come from the store
    donor = engine.new_cache(batch)
    engine.backend.step(_rows(engine, batch, 0, m), donor)
    seg = SharedSegment.from_cache(donor, 0, m)
    fp = model_fingerprint(engine.loaded)
    identity = Identity.of(fp, processor_settings(engine.loaded), content=image_content(image))
    embeds = engine.backend.embed(batch)[0, :m]
    record = Record.from_segment(seg, identity, "alice", embeds)
    assert record.length == m and record.keys[0].shape == (
        engine.backend.num_kv_heads,
        m,
        engine.backend.head_dim,
    )
    assert int((record.modality == Modality.IMAGE).sum()) == int(
        (batch.modality[0, :m] == Modality.IMAGE).sum()
    )
    ContextStore([DiskTier(tmp_path, 1 << 24)], model_fingerprint=fp).put(record)

    # another process: a fresh store on the same directory, a fresh pool
    store = ContextStore([HostTier(1 << 24), DiskTier(tmp_path, 1 << 24)], model_fingerprint=fp)
    loaded = store.find(identity, "alice")
    assert loaded is not None and store.find(identity, "bob") is None
    cache = engine.new_cache(batch)
    linked = loaded.to_segment(cache.pool)
    for layer, (a, b) in enumerate(zip(seg.ids, linked.ids)):
        ka, va = donor.pool.read(layer, a[None])
        kb, vb = cache.pool.read(layer, b[None])
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert bool(cache.pool.is_prerope(layer, b[None]).all())
    linked.link(cache, batch.positions[0, :m])
    out = engine.backend.step(_rows(engine, batch, m, n), cache)
    cache.processed += m  # the linked rows were processed, by the donor
    tokens, policy = [int(out.logits.argmax(-1))], make_policy("full")
    for step in range(1, 6):
        out = engine.decode(torch.tensor(tokens[-1:]), batch, policy, cache, step)
        tokens.append(int(out.logits.argmax(-1)))
    assert tokens == want


def test_a_record_of_another_shape_is_refused_by_the_pool(engine):
    batch = engine.encode([Prompt("Hi", [make_image(1)])])
    pool = engine.new_cache(batch).pool
    with pytest.raises(ValueError, match="pool"):
        make_record(layers=1).to_segment(pool)
