"""The linker: a selective (non-contiguous) prefill over linked entries equals full recompute when the
linked entries are exact; none / mpic with k >= image length / prefix give the full-recompute tokens;
stored images are hits whatever the prompt around them."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.kv.segments import SharedSegment
from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.records import RecordSource
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

MODELS = ["tiny-llava", "tiny-llava-next", "tiny-qwen2-vl"]
NEW = 6


def _decode(engine, batch, cache, out, n_new: int) -> list[int]:
    tokens, policy = [int(out.logits.argmax(-1))], make_policy("full")
    for step in range(1, n_new):
        out = engine.decode(torch.tensor(tokens[-1:]), batch, policy, cache, step)
        tokens.append(int(out.logits.argmax(-1)))
    return tokens


def _linked(engine, prompt, spec, store):
    batch = engine.encode([prompt])
    cache = engine.new_cache(batch, pool=store.pool)
    out, stats = link_prefill(
        engine, batch, prompt.images, cache, spec, RecordSource.for_engine(engine, store)
    )
    return batch, cache, out, stats


def _pool(engine):
    return engine.new_cache(engine.encode([Prompt("x")])).pool


def _full(engine, prompt) -> list[int]:
    return engine.generate([prompt], make_policy("full"), NEW, stop_at_eos=False).samples[0].token_ids


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("k", [0, 3])
def test_selective_prefill_over_exact_entries_equals_full_recompute(name, k, engines, images):
    engine = engines[name]
    prompt = Prompt("First this one, then the other: what differs?", [images[0], images[1]])
    batch = engine.encode([prompt])
    full = engine.new_cache(batch)
    want = engine.prefill(batch, make_policy("full"), full)
    # records cut from the full prefill itself: linking them back is exact, so any difference is the
    # selective step's masking of the non-contiguous rows
    store = SegmentStore(full.pool)
    source = RecordSource.for_engine(engine, store)
    for img, (a, b) in zip(prompt.images, batch.spans[0].image_spans):
        store.images[source.key(source.identity(img))] = SharedSegment.from_cache(full, a, b)
    cache = engine.new_cache(batch, pool=full.pool)
    out, stats = link_prefill(engine, batch, prompt.images, cache, LinkSpec("mpic", k), source)
    assert stats.hits == 2 and stats.reused_tokens == batch.spans[0].num_image_tokens - 2 * k
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(cache.layers, full.layers):  # tables back in sequence order, same keys
        assert torch.equal(a.positions[:, :, : a.max_length], b.positions[:, :, : b.max_length])
        torch.testing.assert_close(a.attention_kv()[0], b.attention_kv()[0], rtol=1e-4, atol=1e-4)
    assert _decode(engine, batch, cache, out, NEW) == _full(engine, prompt)


@pytest.mark.parametrize("name", MODELS)
def test_none_mpic_beyond_the_image_and_prefix_give_the_full_tokens(name, engines, images):
    engine = engines[name]
    prompt = Prompt("Describe the picture.", [images[2]])
    want = _full(engine, prompt)
    store = SegmentStore(_pool(engine))
    for spec in (LinkSpec("none"), LinkSpec("mpic", 10_000), LinkSpec("mpic", 10_000)):
        batch, cache, out, _ = _linked(engine, prompt, spec, store)
        assert _decode(engine, batch, cache, out, NEW) == want, spec
    # prefix: the first request stores its prompt, the second reuses all of it but the last token
    store = SegmentStore(_pool(engine))
    _linked(engine, prompt, LinkSpec("prefix"), store)
    batch, cache, out, stats = _linked(engine, prompt, LinkSpec("prefix"), store)
    assert stats.hits == 1 and stats.recomputed_tokens == 1
    assert _decode(engine, batch, cache, out, NEW) == want


@pytest.mark.parametrize("name", MODELS)
def test_images_stored_in_another_order_link_to_their_own_spans(name, engines, images):
    """Records computed with the pictures reversed, linked with full reuse: every image span's first
    layer K/V (context-free: the image's own embeddings at its own positions) equal full recompute's,
    so each picture's record lands on its own span, rotated to its new positions."""
    engine = engines[name]
    store = SegmentStore(_pool(engine))
    _linked(engine, Prompt("Describe these.", [images[1], images[0]]), LinkSpec("full-reuse"), store)
    prompt = Prompt("Which one is brighter?", [images[0], images[1]])
    batch, cache, _, stats = _linked(engine, prompt, LinkSpec("full-reuse"), store)
    assert stats.hits == 2 and stats.misses == 0
    full = engine.new_cache(batch, pool=store.pool)
    engine.prefill(batch, make_policy("full"), full)
    n = int(batch.lengths[0])
    spans = batch.spans[0].image_spans
    assert len(spans) == 2
    (k_link, v_link), (k_full, v_full) = cache.layers[0].attention_kv(n), full.layers[0].attention_kv(n)
    for a, b in spans:
        torch.testing.assert_close(k_link[..., a:b, :], k_full[..., a:b, :], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v_link[..., a:b, :], v_full[..., a:b, :], rtol=1e-4, atol=1e-4)
    # the two pictures differ, so a swapped record could not pass the check above
    (a0, b0), (a1, b1) = spans
    if b0 - a0 == b1 - a1:
        assert not torch.allclose(v_full[..., a0:b0, :], v_full[..., a1:b1, :], atol=1e-3)


@pytest.mark.parametrize("name", MODELS)
def test_a_stored_image_is_a_hit_in_any_prompt_around_it(name, engines, images):
    engine = engines[name]
    store = SegmentStore(_pool(engine))
    _, _, _, first = _linked(
        engine, Prompt("Compare these.", [images[0], images[1]]), LinkSpec("mpic", 2), store
    )
    assert (first.hits, first.misses) == (0, 2) and len(store.images) == 2
    for prompt in (
        Prompt("Compare these.", [images[1], images[0]]),  # reordered
        Prompt("You are terse. Compare these two.", [images[0], images[1]]),  # other system text
        Prompt("Here is a long preamble before the picture appears at last. What is it?", [images[1]]),
        Prompt("Same one twice?", [images[0], images[0]]),  # one record linked twice
    ):
        batch, cache, out, stats = _linked(engine, prompt, LinkSpec("mpic", 2), store)
        assert stats.misses == 0 and stats.hits == len(prompt.images)
        assert len(_decode(engine, batch, cache, out, 3)) == 3
    assert len(store.images) == 2


def test_bad_link_settings_are_one_line():
    with pytest.raises(
        ValueError, match="unknown link method 'blend'; known: none, prefix, full-reuse, cacheblend, mpic"
    ):
        LinkSpec("blend")
    with pytest.raises(ValueError, match="link k must be an integer >= 0, got -1"):
        LinkSpec("mpic", -1)


def test_generate_links_later_prompts_to_earlier_images_and_reports_it(engines, images):
    engine = engines["tiny-llava"]
    prompts = [
        Prompt("What is this?", [images[0], images[1]]),
        Prompt("And now, reversed?", [images[1], images[0]]),
    ]
    res = engine.generate(prompts, make_policy("full"), 4, stop_at_eos=False, link=LinkSpec("mpic", 2))
    store = res.extras["store"]
    assert (store["hits"], store["misses"]) == (2, 2)
    assert store["recomputed_tokens"] < sum(s.prompt_tokens for s in res.samples)
    assert len(res.extras["ttft_s"]) == 2
    plain = engine.generate(prompts[:1], make_policy("full"), 4, stop_at_eos=False)
    assert res.samples[0].token_ids == plain.samples[0].token_ids  # the first prompt found nothing to link
    with pytest.raises(ValueError, match="drops prompt rows inside the prefill"):
        engine.generate(
            prompts, make_policy("avl", budget=0.5, prefill_keep=0.5), 4, link=LinkSpec("mpic", 2)
        )


@pytest.mark.parametrize("name", MODELS)
def test_hits_skip_the_vision_tower_and_give_the_same_tokens(name, engines, images, monkeypatch):
    engine = engines[name]
    store = SegmentStore(_pool(engine))
    prompt = Prompt("Compare the two.", [images[0], images[2]])
    _linked(engine, prompt, LinkSpec("mpic", 3), store)  # computes and keeps both images
    adapter = engine.backend.adapter
    calls = []
    real = adapter.image_features
    monkeypatch.setattr(adapter, "image_features", lambda v: calls.append(v) or real(v))
    batch, cache, out, stats = _linked(engine, prompt, LinkSpec("mpic", 3), store)
    assert stats.hits == 2 and calls == []  # the first k rows' embeddings came from the records
    with_records = _decode(engine, batch, cache, out, NEW)
    for seg in store.images.values():
        seg.embeds = None  # now the linker must run the vision tower for those rows
    batch, cache, out, _ = _linked(engine, prompt, LinkSpec("mpic", 3), store)
    assert len(calls) == 1 and _decode(engine, batch, cache, out, NEW) == with_records


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("policy", ["snapkv", "vlcache", "h2o"])
def test_a_policy_compresses_the_linked_cache_from_the_link_steps_statistics(name, policy, engines, images):
    engine = engines[name]
    # text after the images longer than SnapKV's window: every row it observes is recomputed
    question = "First this one, then the other: what differs, and why? " * 8
    prompt = Prompt(question, [images[0], images[1]])
    batch = engine.encode([prompt])
    full = engine.new_cache(batch)
    pol = make_policy(policy, budget=0.4)
    engine.prefill(batch, pol, full)  # the policy's choice on a plain prefill
    # exact records cut from a full prefill: with the last rows recomputed, SnapKV's window and
    # VL-Cache's post-vision rows see the same attention as in a plain prefill
    ref = engine.new_cache(batch)
    engine.prefill(batch, make_policy("full"), ref)
    store = SegmentStore(ref.pool)
    source = RecordSource.for_engine(engine, store)
    for img, (a, b) in zip(prompt.images, batch.spans[0].image_spans):
        store.images[source.key(source.identity(img))] = SharedSegment.from_cache(ref, a, b)
    cache = engine.new_cache(batch, pool=ref.pool)
    ctx = engine.context(batch)
    out, _ = link_prefill(
        engine,
        batch,
        prompt.images,
        cache,
        LinkSpec("mpic", 2),
        source,
        pol.prefill_request(ctx, int(batch.lengths[0])),
    )
    from vlkv.runtime.edits import apply_edits

    apply_edits(cache, pol.after_prefill(cache, out.stats, ctx))
    assert cache.kv_bytes() < 0.6 * ref.kv_bytes()  # really compressed
    if policy != "h2o":  # H2O scores every row; linked rows ran no query, so its choice may differ
        for a, b in zip(cache.layers, full.layers):
            assert torch.equal(a.positions[:, :, : a.max_length], b.positions[:, :, : b.max_length])
