"""CacheBlend-r: r = 1 is full recompute, r = 0 is full-reuse, and the recomputed rows are the stored
image rows whose check-layer K (or V) deviates most from a plain full prefill of the same prompt."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.link.cacheblend import CHECK_LAYER, blend_rows
from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.records import RecordSource
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

MODELS = ["tiny-llava", "tiny-qwen2-vl"]  # 1-D RoPE and M-RoPE
NEW = 6


def _stored(engine, images):
    """A store holding both images, computed alone by a first linking request."""
    store = SegmentStore(engine.new_cache(engine.encode([Prompt("x")])).pool)
    _link(engine, Prompt("Look at these.", [images[0], images[1]]), LinkSpec("full-reuse"), store)
    return store


def _link(engine, prompt, spec, store):
    batch = engine.encode([prompt])
    cache = engine.new_cache(batch, pool=store.pool)
    out, stats = link_prefill(
        engine, batch, prompt.images, cache, spec, RecordSource.for_engine(engine, store)
    )
    return batch, cache, out, stats


def _tokens(engine, batch, cache, out) -> list[int]:
    tokens, policy = [int(out.logits.argmax(-1))], make_policy("full")
    for step in range(1, NEW):
        out = engine.decode(torch.tensor(tokens[-1:]), batch, policy, cache, step)
        tokens.append(int(out.logits.argmax(-1)))
    return tokens


PROMPT = "Here they are in the other order; which is brighter?"


@pytest.mark.parametrize("name", MODELS)
def test_r_one_is_full_recompute_and_r_zero_is_full_reuse(name, engines, images):
    engine = engines[name]
    store = _stored(engine, images)
    prompt = Prompt(PROMPT, [images[1], images[0]])
    full = engine.generate([prompt], make_policy("full"), NEW, stop_at_eos=False).samples[0].token_ids
    batch, cache, out, stats = _link(engine, prompt, LinkSpec("cacheblend", r=1.0), store)
    assert stats.hits == 2 and stats.reused_tokens == 0
    assert _tokens(engine, batch, cache, out) == full
    reuse = _link(engine, prompt, LinkSpec("full-reuse"), store)
    blend = _link(engine, prompt, LinkSpec("cacheblend", r=0.0), store)
    assert blend[3].reused_tokens == reuse[3].reused_tokens == batch.spans[0].num_image_tokens
    torch.testing.assert_close(blend[2].logits, reuse[2].logits, rtol=0, atol=0)
    assert _tokens(engine, *blend[:3]) == _tokens(engine, *reuse[:3])


def _reference_rows(engine, batch, store, images, spec) -> torch.Tensor:
    """The top ``int(r * m)`` stored rows by check-layer deviation, from a plain full prefill."""
    full = engine.new_cache(batch)
    engine.prefill(batch, make_policy("full"), full)
    k, v = full.layers[CHECK_LAYER].attention_kv()  # (1, H_kv, n, D), keys at their positions
    source = RecordSource.for_engine(engine, store)
    devs, rows = [], []
    for img, (a, b) in zip(images, batch.spans[0].image_spans):
        seg = store.images[source.key(source.identity(img))]
        sk, sv = store.pool.read(CHECK_LAYER, seg.ids[CHECK_LAYER][None])
        if spec.deviation == "k":
            pos = batch.positions[0, a:b][None, None].expand(1, sk.shape[1], -1, -1)
            diff = k[:, :, a:b] - store.pool.rope(sk, pos)
        else:
            diff = v[:, :, a:b] - sv
        devs.append(diff.float().square().sum(dim=(0, 1, 3)))
        rows.append(torch.arange(a, b))
    dev, rows = torch.cat(devs), torch.cat(rows)
    return rows[dev.topk(int(spec.r * rows.numel())).indices].sort().values


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("deviation", ["k", "v"])
def test_the_recomputed_rows_are_the_top_by_deviation(name, deviation, engines, images):
    engine = engines[name]
    store = _stored(engine, images)
    prompt = Prompt(PROMPT, [images[1], images[0]])
    batch = engine.encode([prompt])
    spec = LinkSpec("cacheblend", r=0.15, deviation=deviation)
    source = RecordSource.for_engine(engine, store)
    hits = {i: source.lookup(source.identity(img)) for i, img in enumerate(prompt.images)}
    emb = engine.backend.embed(batch)
    got = blend_rows(engine, batch, emb, hits, spec)
    want = _reference_rows(engine, batch, store, prompt.images, spec)
    m = batch.spans[0].num_image_tokens
    assert got.numel() == int(0.15 * m) > 0
    assert torch.equal(got, want)
    # the link step recomputes exactly those rows plus the text
    _, cache, out, stats = _link(engine, prompt, spec, store)
    assert stats.reused_tokens == m - got.numel()
    assert stats.recomputed_tokens == int(batch.lengths[0]) - m + got.numel()
    linked = torch.cat([lay.order[0, 0, : lay.max_length] for lay in cache.layers[:1]])
    assert linked.numel() == int(batch.lengths[0])  # every row present once, in sequence order
    assert torch.equal(linked, torch.arange(int(batch.lengths[0])))


def test_cacheblend_is_closer_to_full_recompute_than_full_reuse(engines, images):
    engine = engines["tiny-llava"]
    store = _stored(engine, images)
    prompt = Prompt(PROMPT, [images[1], images[0]])
    batch = engine.encode([prompt])
    want = engine.prefill(batch, make_policy("full"), engine.new_cache(batch)).logits
    errs = {}
    for spec in (LinkSpec("full-reuse"), LinkSpec("cacheblend", r=0.5)):
        errs[spec.method] = float((_link(engine, prompt, spec, store)[2].logits - want).abs().max())
    assert errs["cacheblend"] < errs["full-reuse"]


def test_bad_cacheblend_settings_are_one_line():
    with pytest.raises(ValueError, match="link r must be a fraction in \\[0, 1\\], got 1.5"):
        LinkSpec("cacheblend", r=1.5)
    with pytest.raises(ValueError, match="link deviation must be one of k, v, got 'q'"):
        LinkSpec("cacheblend", deviation="q")
