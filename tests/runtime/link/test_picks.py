"""MPIC's choice of recomputed tokens (``LinkSpec.pick``): the link step recomputes exactly the rows the
choice names (every other stored row is linked), ``ramp`` spreads MPIC's budget toward later images, and
k >= an image's length is full recompute."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.link.test_cacheblend import _link
from vlkv.runtime.link.picks import ramp_counts, recompute_rows
from vlkv.runtime.link.records import RecordSource
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

MODELS = ["tiny-llava", "tiny-qwen2-vl"]  # 1-D RoPE and M-RoPE
NEW = 6
PROMPT = "Here they are in another order; which is brighter?"


def test_ramp_counts_spend_mpics_budget_on_later_images():
    assert ramp_counts([64] * 10, 32) == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert sum(ramp_counts([64] * 10, 32)) == 320
    assert ramp_counts([64] * 4, 0) == [0, 0, 0, 0]
    assert ramp_counts([10, 20, 5], 1000) == [10, 20, 5]  # k >= every image: all of them
    assert ramp_counts([8, 8], 6) == [4, 8]  # the later image full, the rest to the first
    assert ramp_counts([], 32) == []
    with pytest.raises(ValueError, match="k must be >= 0, got -1"):
        ramp_counts([8], -1)


def _stored(engine, images):
    store = SegmentStore(engine.new_cache(engine.encode([Prompt("x")])).pool)
    _link(engine, Prompt("Look at these.", images), LinkSpec("full-reuse"), store)
    return store


def _hits(engine, store, prompt):
    source = RecordSource.for_engine(engine, store)
    return {i: source.lookup(source.identity(img)) for i, img in enumerate(prompt.images)}


def _linked_mask(cache, n: int) -> torch.Tensor:
    layer = cache.layers[0]
    return layer.pool.is_prerope(layer.layer, layer.slots[:, :, :n].clamp(min=0))[0, 0].cpu()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("pick", ["first", "ramp"])
def test_the_link_step_recomputes_exactly_the_chosen_rows(name, pick, engines, images):
    engine = engines[name]
    imgs = [images[0], images[1], images[2]]
    store = _stored(engine, imgs[::-1])
    prompt = Prompt(PROMPT, imgs)
    batch = engine.encode([prompt])
    spans = batch.spans[0].image_spans
    k = (spans[0][1] - spans[0][0]) // 3
    spec = LinkSpec("mpic", k, pick=pick)
    rows = recompute_rows(engine, batch, engine.backend.embed(batch), _hits(engine, store, prompt), spec)
    sizes = [b - a for a, b in spans]
    counts = ramp_counts(sizes, k) if pick == "ramp" else [min(k, s) for s in sizes]
    want = torch.cat([torch.arange(a, a + c) for (a, _), c in zip(spans, counts)])
    assert torch.equal(rows.cpu(), want)
    if pick == "ramp":
        assert counts[0] < counts[-1] and sum(counts) == k * len(sizes)
    assert rows.numel() == k * len(sizes) > 0
    _, cache, _, stats = _link(engine, prompt, spec, store)
    n, m = int(batch.lengths[0]), sum(sizes)
    assert stats.hits == 3
    assert stats.recomputed_tokens == n - m + rows.numel()
    assert stats.reused_tokens == m - rows.numel()
    image = torch.zeros(n, dtype=torch.bool)
    for a, b in spans:
        image[a:b] = True
    want_linked = image.clone()
    want_linked[rows.cpu()] = False
    assert torch.equal(_linked_mask(cache, n), want_linked)


@pytest.mark.parametrize("name", MODELS)
def test_k_of_a_whole_image_is_full_recompute(name, engines, images):
    engine = engines[name]
    store = _stored(engine, [images[1], images[0]])
    prompt = Prompt(PROMPT, [images[0], images[1]])
    full = engine.generate([prompt], make_policy("full"), NEW, stop_at_eos=False).samples[0].token_ids
    batch, cache, out, stats = _link(engine, prompt, LinkSpec("mpic", 10_000, pick="ramp"), store)
    assert stats.hits == 2 and stats.reused_tokens == 0
    tokens, policy = [int(out.logits.argmax(-1))], make_policy("full")
    for step in range(1, NEW):
        out = engine.decode(torch.tensor(tokens[-1:]), batch, policy, cache, step)
        tokens.append(int(out.logits.argmax(-1)))
    assert tokens == full


def test_an_unknown_pick_is_one_line():
    with pytest.raises(ValueError, match="unknown MPIC pick 'last'; known: first, ramp"):
        LinkSpec("mpic", pick="last")
