"""Linking records stored as low-rank factors (``store_rank``): every hit links the same rank-R
K/V (device tier or bytes), a hit from disk moves fewer bytes, full rank gives the dense record's
tokens, the rank is part of the record key, and the correctness gate measures factored links."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.link.test_compressed import _link
from vlkv.runtime.kv.lowrank import truncated_svd
from vlkv.runtime.kv.segments import SharedSegment
from vlkv.runtime.link.compress import factor_segment
from vlkv.runtime.link.gate import load_check, run_link_check
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.store.identity import model_fingerprint

MODELS = ["tiny-llava", "tiny-qwen2-vl"]


def test_factor_segment_cuts_every_layer_to_rank_r(engines, images):
    engine = engines["tiny-llava"]
    batch = engine.encode([Prompt("x", [images[2]])])
    cache = engine.new_cache(batch)
    engine.prefill(batch, make_policy("full"), cache)
    a, b = batch.spans[0].image_spans[0]
    seg = SharedSegment.from_cache(cache, a, b)
    dense = [seg.pool.read(layer, ids[None]) for layer, ids in enumerate(seg.ids)]
    small = factor_segment(seg, 3)
    assert small.rank == 3 and seg.length == 0 and small.length == b - a
    for layer, ids in enumerate(small.ids):
        k, v = small.pool.read(layer, ids[None])
        for got, want in ((k, dense[layer][0]), (v, dense[layer][1])):
            h, m, d = want.shape[1:]
            mat = want[0].permute(1, 0, 2).reshape(m, h * d).double()
            x, y = truncated_svd(mat, 3, exact=True)
            ref = (x @ y).view(m, h, d).permute(1, 0, 2)
            torch.testing.assert_close(got[0].double(), ref.double(), rtol=1e-4, atol=1e-4)
            assert (
                torch.linalg.matrix_rank(got[0].permute(1, 0, 2).reshape(m, h * d).double(), rtol=1e-4) <= 3
            )
    with pytest.raises(ValueError, match="store rank must be an integer >= 0"):
        LinkSpec("mpic", store_rank=-1)


@pytest.mark.parametrize("name", MODELS)
def test_a_factored_hit_moves_fewer_bytes_and_links_the_rank_r_entries(name, engines, images, tmp_path):
    engine = engines[name]
    first, later = Prompt("Look.", [images[0]]), Prompt("Another question about it?", [images[0]])
    loaded = {}
    for rank in (0, 4):
        spec = LinkSpec("full-reuse", store_rank=rank)
        _, _, _, _, writer = _link(engine, first, spec, tmp_path / str(rank))
        (computed,) = writer.segments.images.values()  # what the writing request linked itself
        batch, cache, _, stats, source = _link(engine, later, spec, tmp_path / str(rank))
        assert stats.hits == 1 and stats.dropped_tokens == 0
        loaded[rank] = stats.bytes_loaded
        (seg,) = source.segments.images.values()  # read from disk, reconstructed
        assert (getattr(seg, "rank", None) or 0) == rank
        for layer in range(len(cache.layers)):
            k_disk, v_disk = seg.pool.read(layer, seg.ids[layer][None])
            k_mem, v_mem = computed.pool.read(layer, computed.ids[layer][None])
            # the device-tier segment and the record read back hold the same K/V
            torch.testing.assert_close(k_disk, k_mem, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v_disk, v_mem, rtol=1e-4, atol=1e-4)
    assert loaded[4] < 0.6 * loaded[0]


def test_full_rank_records_give_the_dense_records_tokens(engines, images, tmp_path):
    engine = engines["tiny-llava"]
    prompts = [Prompt("What is it?", [images[1]]), Prompt("And now, what is it?", [images[1]])]
    kw = {"stop_at_eos": False, "store": None}
    dense = engine.generate(prompts, make_policy("full"), 6, link=LinkSpec("mpic", 4), link_threshold=0, **kw)
    full = engine.generate(
        prompts, make_policy("full"), 6, link=LinkSpec("mpic", 4, store_rank=10**6), link_threshold=0, **kw
    )
    assert full.extras["store"]["hits"] == 1
    assert [s.token_ids for s in full.samples] == [s.token_ids for s in dense.samples]


def test_rank_is_part_of_the_record_key(engines, images, tmp_path):
    engine = engines["tiny-llava"]
    first, later = Prompt("Look.", [images[0]]), Prompt("Another question about it?", [images[0]])
    _link(engine, first, LinkSpec("full-reuse", store_rank=4), tmp_path)
    for spec, hit in ((LinkSpec("full-reuse"), 0), (LinkSpec("full-reuse", store_rank=8), 0),
                      (LinkSpec("full-reuse", store_rank=4), 1)):  # fmt: skip
        _, _, _, stats, _ = _link(engine, later, spec, tmp_path)
        assert stats.hits == hit, spec


def test_the_gate_measures_factored_links(engines):
    engine = engines["tiny-llava"]
    spec = LinkSpec("mpic", 4, store_rank=2)
    check = run_link_check(engine, spec, tokens=6)
    fp = model_fingerprint(engine.loaded)
    assert load_check(fp, spec) == check and load_check(fp, LinkSpec("mpic", 4)) != check
    assert check.store_rank == 2 and "rank 2" in check.name
