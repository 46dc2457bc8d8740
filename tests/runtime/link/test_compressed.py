"""Linking compressed records: the chosen entries are head-uniform and match a plain reference, a
hit moves fewer bytes and links only the kept entries (at their own positions), recomputing every
row gives the full tokens, and the correctness gate measures the compressed link."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.kv.segments import SharedSegment
from vlkv.runtime.link.compress import choose_entries, compress_segment, kept_count
from vlkv.runtime.link.gate import load_check, run_link_check
from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.records import RecordSource
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.store import ContextStore
from vlkv.runtime.store.identity import model_fingerprint

MODELS = ["tiny-llava", "tiny-qwen2-vl"]


def test_keynorm_keeps_the_lowest_relative_norms_in_every_head():
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(2, 20, 8, generator=g) * (layer + 1) for layer in range(3)]
    got = choose_entries(keys, 0.3, "keynorm")
    score = torch.zeros(20)
    for k in keys:  # plain loops: each (layer, head) row of norms over its own mean
        for h in range(k.shape[0]):
            norms = torch.tensor([float(k[h, j].norm()) for j in range(20)])
            score += norms / norms.mean()
    want = score.argsort()[: kept_count(20, 0.3)].sort().values
    assert torch.equal(got, want) and got.numel() == 6
    assert torch.equal(choose_entries(keys, 0.5, "stride"), torch.linspace(0, 19, 10).round().long())
    assert torch.equal(choose_entries(keys, 1.0), torch.arange(20))
    with pytest.raises(ValueError, match="unknown record scorer 'attn'"):
        choose_entries(keys, 0.5, "attn")


def test_bad_store_budget_is_one_line():
    with pytest.raises(ValueError, match="store budget must be a fraction in \\(0, 1\\], got 0"):
        LinkSpec("mpic", store_budget=0)
    with pytest.raises(ValueError, match="unknown record scorer 'x'"):
        LinkSpec("mpic", store_scorer="x")


def _link(engine, prompt, spec, store_dir):
    """One request through a fresh store object (a new process's view) and a fresh pool."""
    batch = engine.encode([prompt])
    pool = engine.new_cache(batch).pool
    source = RecordSource.for_engine(engine, SegmentStore(pool), ContextStore.open(store_dir, host_bytes=0))
    cache = engine.new_cache(batch, pool=pool)
    out, stats = link_prefill(engine, batch, prompt.images, cache, spec, source)
    return batch, cache, out, stats, source


@pytest.mark.parametrize("name", MODELS)
def test_a_compressed_hit_moves_fewer_bytes_and_links_the_kept_entries(name, engines, images, tmp_path):
    engine = engines[name]
    first, later = Prompt("Look.", [images[0]]), Prompt("Another question about it?", [images[0]])
    loaded = {}
    for budget in (1.0, 0.5):
        spec = LinkSpec("full-reuse", store_budget=budget)
        _link(engine, first, spec, tmp_path / str(budget))  # writes the record
        batch, cache, out, stats, source = _link(engine, later, spec, tmp_path / str(budget))
        a, b = batch.spans[0].image_spans[0]
        m = kept_count(b - a, budget)
        assert stats.hits == 1 and stats.reused_tokens == m and stats.dropped_tokens == b - a - m
        assert stats.recomputed_tokens == int(batch.lengths[0]) - (b - a)
        loaded[budget] = stats.bytes_loaded
        (seg,) = source.segments.images.values()
        off = getattr(seg, "offsets", None)
        off = torch.arange(b - a) if off is None else off
        for layer, lay in enumerate(cache.layers):  # text rows and the kept image rows, in order
            order = lay.order[0, 0, : lay.max_length]
            want = torch.cat([torch.arange(a), a + off, torch.arange(b, int(batch.lengths[0]))])
            assert torch.equal(order.cpu(), want)
            k = lay.attention_kv()[0][0, :, a : a + m]  # linked keys, rotated to their positions
            sk = seg.pool.read(layer, seg.ids[layer][None])[0]
            pos = batch.positions[0, a + off][None, None].expand(1, sk.shape[1], -1, -1)
            torch.testing.assert_close(k, seg.pool.rope(sk, pos)[0], rtol=1e-5, atol=1e-5)
    assert loaded[0.5] < 0.75 * loaded[1.0]  # K/V halve; the embeddings stay whole


@pytest.mark.parametrize("name", MODELS)
def test_recomputing_every_row_of_a_compressed_hit_gives_the_full_tokens(name, engines, images, tmp_path):
    engine = engines[name]
    prompt = Prompt("What is shown?", [images[1]])
    want = engine.generate([prompt], make_policy("full"), 5, stop_at_eos=False).samples[0].token_ids
    spec = LinkSpec("mpic", 10_000, store_budget=0.25)
    _link(engine, prompt, spec, tmp_path)
    batch, cache, out, stats, _ = _link(engine, prompt, spec, tmp_path)
    assert stats.hits == 1 and stats.dropped_tokens == 0 and stats.reused_tokens == 0
    tokens, policy = [int(out.logits.argmax(-1))], make_policy("full")
    for step in range(1, 5):
        tokens.append(
            int(engine.decode(torch.tensor(tokens[-1:]), batch, policy, cache, step).logits.argmax(-1))
        )
    assert tokens == want


def test_compress_segment_keeps_the_chosen_entries_exactly(engines, images):
    engine = engines["tiny-llava"]
    batch = engine.encode([Prompt("x", [images[2]])])
    cache = engine.new_cache(batch)
    engine.prefill(batch, make_policy("full"), cache)
    a, b = batch.spans[0].image_spans[0]
    seg = SharedSegment.from_cache(cache, a, b)
    dense = [seg.pool.read(layer, ids[None]) for layer, ids in enumerate(seg.ids)]
    small = compress_segment(seg, 0.4)
    assert small.length == kept_count(b - a, 0.4) and seg.length == 0  # the dense one was released
    for layer, ids in enumerate(small.ids):
        k, v = small.pool.read(layer, ids[None])
        assert torch.equal(k, dense[layer][0][:, :, small.offsets]) and torch.equal(
            v, dense[layer][1][:, :, small.offsets]
        )


def test_the_gate_measures_compressed_links(engines, images):
    engine = engines["tiny-llava"]
    dense = run_link_check(engine, LinkSpec("mpic", 4), tokens=8)
    small = run_link_check(engine, LinkSpec("mpic", 4, store_budget=0.5), tokens=8)
    fp = model_fingerprint(engine.loaded)
    assert load_check(fp, LinkSpec("mpic", 4, store_budget=0.5)) == small
    assert load_check(fp, LinkSpec("mpic", 4)) == dense and small != dense
    assert small.store_budget == 0.5 and "records at 0.5" in small.name
    # a request that writes and links compressed records is gated by the compressed measurement
    prompts = [Prompt("What is it?", [images[0]]), Prompt("And this time?", [images[0]])]
    spec = LinkSpec("mpic", 4, store_budget=0.5)
    above = small.agreement + 0.01
    res = engine.generate(prompts, make_policy("full"), 2, stop_at_eos=False, link=spec, link_threshold=above)
    assert small.agreement < 1.0  # half the entries gone: lossy, so a threshold above it exists
    (why,) = res.extras["link_refused"]
    assert "records at 0.5" in why and f"agreed {small.agreement:.2f}" in why
    assert res.extras["store"]["hits"] == 0
    res = engine.generate(
        prompts, make_policy("full"), 2, stop_at_eos=False, link=spec, link_threshold=small.agreement
    )
    assert "link_refused" not in res.extras and res.extras["store"]["hits"] == 1
    assert res.extras["store"]["dropped_tokens"] > 0


@pytest.mark.parametrize("name", MODELS)
def test_kvzip_records_keep_the_entries_the_replay_attends_most(name, engines, images, tmp_path):
    from vlkv.runtime.backend import StepInputs
    from vlkv.runtime.link.linker import standalone_segment
    from vlkv.runtime.link.sink import sink_ids, with_sink
    from vlkv.runtime.replay import ReplayRequest

    engine = engines[name]
    prompt = Prompt("Look.", [images[2]])
    batch = engine.encode([prompt])
    emb = engine.backend.embed(batch)
    a, b = batch.spans[0].image_spans[0]
    n = b - a
    # plain reference: the sink prefilled alone, the stored image linked after it at its standalone
    # positions, the two replayed, the image's entries ranked with loops
    pool = engine.new_cache(batch).pool
    seg = standalone_segment(engine, batch, emb, (a, b), pool)
    cache = engine.new_cache(batch, pool=pool)
    pos = batch.positions[:, a:b]
    embeds, _, _, _, s = with_sink(
        engine, emb[:, a:b], pos - pos.amin(1, keepdim=True), batch.input_ids[:, a:b], batch.modality[:, a:b]
    )
    sink = torch.tensor([sink_ids(engine)])
    sink_pos = torch.arange(s)[None, :, None].expand(1, s, pos.shape[-1])
    engine.backend.step(
        StepInputs(sink, sink_pos, torch.zeros(1, s, dtype=torch.int8), torch.tensor([s]), embeds[:, :s]),
        cache,
    )
    seg.link(cache, pos[0] - pos[0].amin(0) + s)  # right after the sink (M-RoPE: its grid ids, shifted)
    ids = engine.tokenizer(ReplayRequest().template, add_special_tokens=False)["input_ids"]
    scores = engine.backend.replay(ReplayRequest(), cache, embeds, torch.tensor([s + n]), torch.tensor(ids))
    want_score = torch.zeros(n)
    for sc in scores:
        row = torch.tensor([max(float(sc[0, h, s + j]) for h in range(sc.shape[1])) for j in range(n)])
        want_score += row / row.mean() / len(scores)
    want = want_score.argsort(descending=True)[: kept_count(n, 0.5)].sort().values
    got = compress_segment(standalone_segment(engine, batch, emb, (a, b), pool, replay=True), 0.5, "kvzip")
    assert torch.equal(got.offsets, want)
    # end to end: records written with the kvzip scorer are compressed hits
    spec = LinkSpec("full-reuse", store_budget=0.5, store_scorer="kvzip")
    _link(engine, prompt, spec, tmp_path)
    _, _, _, stats, _ = _link(engine, Prompt("Again?", [images[2]]), spec, tmp_path)
    assert stats.hits == 1 and stats.dropped_tokens == n - kept_count(n, 0.5)


def test_budgets_and_scorers_are_separate_records(engines, images, tmp_path):
    """The store budget and scorer are part of the record key: a request asking for dense records never
    links a compressed one of the same image (nor another budget's), and dense keys are unchanged."""
    engine = engines["tiny-llava"]
    first, later = Prompt("Look.", [images[0]]), Prompt("Another question about it?", [images[0]])
    _link(engine, first, LinkSpec("full-reuse", store_budget=0.25), tmp_path)  # a compressed record
    _, _, _, stats, source = _link(engine, later, LinkSpec("full-reuse"), tmp_path)
    assert stats.hits == 0 and stats.misses == 1 and stats.dropped_tokens == 0  # dense asked: no hit
    dense_key = source.key(source.identity(images[0]))
    assert dense_key == source.key(source.identity(images[0], variant=LinkSpec("mpic").record_variant()))
    for spec, hit in (
        (LinkSpec("full-reuse"), 1),  # the dense record the last request wrote
        (LinkSpec("full-reuse", store_budget=0.25), 1),
        (LinkSpec("full-reuse", store_budget=0.25, store_scorer="stride"), 0),
        (LinkSpec("full-reuse", store_budget=0.5), 0),
    ):
        _, _, _, stats, _ = _link(engine, later, spec, tmp_path)
        assert stats.hits == hit, spec
