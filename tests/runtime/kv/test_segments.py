"""Shared segments: pre-RoPE keys rotated on read equal keys computed at those positions; a linked
segment reproduces the full computation token for token; slots are freed with the last reader."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.backend import StepInputs
from vlkv.runtime.kv.segments import SharedSegment
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

MODELS = ["tiny-llava", "tiny-llava-next", "tiny-qwen2-vl"]


def _rows(engine, batch, lo: int, hi: int, shift: int = 0) -> StepInputs:
    """Prefill inputs for prompt rows ``[lo, hi)`` of a one-prompt batch, positions moved by ``shift``."""
    emb = engine.backend.embed(batch)[:, lo:hi]
    return StepInputs(
        batch.input_ids[:, lo:hi],
        batch.positions[:, lo:hi] + shift,
        batch.modality[:, lo:hi],
        torch.tensor([hi - lo]),
        emb,
    )


@pytest.mark.parametrize("name", MODELS)
def test_a_segment_linked_at_new_positions_equals_keys_computed_there(name, engines, images):
    engine = engines[name]
    batch = engine.encode([Prompt("What is in the picture?", [images[0]])])
    n, shift = int(batch.lengths[0]), 37
    here, there = engine.new_cache(batch), engine.new_cache(batch)
    engine.backend.step(_rows(engine, batch, 0, n), here)
    engine.backend.step(_rows(engine, batch, 0, n, shift), there)
    seg = SharedSegment.from_cache(here, 0, n)
    linked = engine.new_cache(batch, pool=here.pool)
    seg.link(linked, batch.positions[0] + shift)
    # layer 0 sees identical inputs at both positions: the rotation alone is compared, at 1e-5
    ka, va = linked.layers[0].attention_kv()
    kb, vb = there.layers[0].attention_kv()
    assert float((ka - kb).abs().max()) <= 1e-5 and torch.equal(va, vb)
    # deeper layers: RoPE is relative, so the model's own inputs there agree up to rounding
    for a, b in zip(linked.layers, there.layers):
        for x, y in zip(a.attention_kv(), b.attention_kv()):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_a_linked_prefix_gives_the_tokens_of_full_recompute(name, engines, images):
    engine = engines[name]
    prompt = Prompt("Describe the picture, then the colours.", [images[1]])
    want = engine.generate([prompt], make_policy("full"), 8, stop_at_eos=False).samples[0].token_ids
    batch = engine.encode([prompt])
    n = int(batch.lengths[0])
    m = n - 5  # the image and most of the text come from the segment
    donor = engine.new_cache(batch)
    engine.backend.step(_rows(engine, batch, 0, m), donor)
    seg = SharedSegment.from_cache(donor, 0, m)
    donor.release()
    cache = engine.new_cache(batch, pool=donor.pool)
    seg.link(cache, batch.positions[0, :m])
    out = engine.backend.step(_rows(engine, batch, m, n), cache)
    cache.processed += m  # the linked rows were processed, by the donor
    tokens, policy = [int(out.logits.argmax(-1))], make_policy("full")
    for step in range(1, 8):
        out = engine.decode(torch.tensor(tokens[-1:]), batch, policy, cache, step)
        tokens.append(int(out.logits.argmax(-1)))
    assert tokens == want


def test_shared_slots_are_freed_by_the_last_reader(engines, images):
    engine = engines["tiny-llava"]
    batch = engine.encode([Prompt("Hi", [images[2]])])
    n = int(batch.lengths[0])
    donor = engine.new_cache(batch)
    engine.backend.step(_rows(engine, batch, 0, n), donor)
    pool = donor.pool
    seg = SharedSegment.from_cache(donor, 0, n)
    donor.release()
    one_copy = pool.used_bytes()
    assert one_copy == n * pool.spec.entry_bytes * pool.spec.num_layers
    readers = [engine.new_cache(batch, pool=pool) for _ in range(3)]
    for i, r in enumerate(readers):
        seg.link(r, batch.positions[0] + 100 * i)
    assert pool.used_bytes() == one_copy  # three readers, one copy
    seg.release()
    readers[0].release()
    readers[1].release()
    assert pool.used_bytes() == one_copy  # the last reader still holds it
    # per-head eviction in the last reader drops different entries per head; all go back in the end
    layer = readers[2].layers[0]
    layer.select(torch.tensor([[[0, 2, 4]] * layer.kv_heads]).clone(), torch.tensor([3]))
    readers[2].release()
    assert pool.used_bytes() == 0


def test_a_segment_follows_pool_compaction(engines, images):
    from vlkv.runtime.kv.pool import COMPACT_MIN_SLOTS

    engine = engines["tiny-llava"]
    batch = engine.encode([Prompt("Hi", [images[0]])])
    n = int(batch.lengths[0])
    pool = engine.new_cache(batch).pool
    filler = engine.new_cache(batch, pool=pool)
    k = torch.randn(1, pool.spec.kv_heads, 2 * COMPACT_MIN_SLOTS, pool.spec.head_dim)
    for layer in filler.layers:  # low slots taken first, so the segment lands high
        layer.append(
            k,
            k,
            torch.arange(k.shape[2])[None, :, None],
            torch.zeros(1, k.shape[2], dtype=torch.int8),
            torch.tensor([k.shape[2]]),
        )
    donor = engine.new_cache(batch, pool=pool)
    engine.backend.step(_rows(engine, batch, 0, n), donor)
    seg = SharedSegment.from_cache(donor, 0, n)
    before = [pool.read(i, ids[None]) for i, ids in enumerate(seg.ids)]
    donor.release()
    filler.release()  # most of the pool comes free: it compacts and moves the segment's slots down
    assert pool.compactions > 0
    for i, ids in enumerate(seg.ids):
        assert int(ids.max()) < pool.capacity(i)
        for x, y in zip(before[i], pool.read(i, ids[None])):
            assert torch.equal(x, y)
    seg.release()
    assert pool.used_bytes() == 0
