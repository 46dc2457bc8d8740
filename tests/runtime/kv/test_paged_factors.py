"""The paged read of low-rank factors (``plugins.paged_lowrank``, tables from ``kv.paged_factors``) equals
path (a) — ``LowRank.fill`` rebuilding every factored row into dense K/V, then the plain paged reference —
on a ragged batch that mixes dense entries, per-head holes, linked pre-RoPE entries and factored rows at
per-row ranks, with the model's own rotary (1-D RoPE: tiny-llava; M-RoPE: tiny-qwen2-vl), fp32/fp16/bf16,
decode and a two-row chunk."""

from __future__ import annotations

import pytest
import torch

from vlkv.plugins.paged_lowrank import paged_lowrank_kv, paged_lowrank_reference
from vlkv.plugins.paged_reference import paged_attention_reference
from vlkv.runtime.attention_rows import _rank_space_one_row
from vlkv.runtime.cache import LayerKV, Modality
from vlkv.runtime.kv.lowrank import factor, set_ranks
from vlkv.runtime.kv.paged import paged_tables
from vlkv.runtime.kv.paged_factors import paged_lowrank_tables, stack_factors
from vlkv.runtime.kv.rope_table import RopeTable, table_as_rows
from vlkv.runtime.op_count import count_ops

H, D, RANK = 2, 16, 6  # the tiny models' KV heads and head dim
LENGTHS = (14, 6, 17)  # ragged: sample 1 holds no image
MODELS = {1: "tiny-llava", 3: "tiny-qwen2-vl"}
# path (a) rotates in the pool's dtype (the model's apply_rotary_pos_emb), the paged read in float32
# then rounds: fp16/bf16 keys may differ by an ulp, so the outputs by a few of their ulps
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def build_layer(rope, pos_dims: int, dtype: torch.dtype, seed: int = 0, post: tuple = ()) -> LayerKV:
    """A one-layer cache of 3 samples: images in samples 0 and 2 factored at rank ``RANK`` with random
    per-row ranks (post-RoPE, path (b), for the samples in ``post``), per-head holes, and 3 linked
    pre-RoPE entries appended to sample 1."""
    g = torch.Generator().manual_seed(seed)
    b, q = len(LENGTHS), max(LENGTHS)
    layer = LayerKV.empty(b, H, D, pos_dims, dtype, "cpu")
    layer.pool.rope = rope
    positions = torch.arange(q)[None, :, None].expand(b, q, pos_dims).clone()
    if pos_dims > 1:  # M-RoPE: image rows and columns as components 1 and 2
        positions[..., 1:] = torch.randint(0, q, (b, q, pos_dims - 1), generator=g)
    modality = torch.full((b, q), int(Modality.TEXT), dtype=torch.int8)
    modality[0, 2:10] = modality[2, 1:14] = int(Modality.IMAGE)
    layer.append(
        torch.randn(b, H, q, D, generator=g).to(dtype),
        torch.randn(b, H, q, D, generator=g).to(dtype),
        positions,
        modality,
        torch.tensor(LENGTHS),
    )
    holes = (torch.rand(b, H, q, generator=g) < 0.2) & (torch.arange(q) > 0)
    layer.select(torch.arange(q).expand(b, H, q), torch.tensor(LENGTHS), holes=holes)
    ids = layer.pool.alloc(layer.layer, 3)
    pre = torch.randn(H, 3, D, generator=g).to(dtype)
    layer.pool.write(layer.layer, ids, pre, torch.randn(H, 3, D, generator=g).to(dtype), prerope=True)
    layer.link(
        ids,
        torch.randint(0, 30, (3, pos_dims), generator=g),
        torch.full((3,), int(Modality.POST_TEXT), dtype=torch.int8),
        1,
    )
    images = (layer.modality == int(Modality.IMAGE)) & layer.valid_mask()[:, None, :] & ~layer.holes
    chosen = torch.zeros(b, dtype=torch.bool)
    chosen[list(post)] = True
    factor(layer, images & ~chosen[:, None, None], rank=RANK, exact=True)
    if post:
        factor(layer, images & chosen[:, None, None], rank=RANK, exact=True, post_rope=True)
    for s, f in enumerate(layer.lowrank.samples):
        if f is not None:
            set_ranks(
                layer,
                s,
                torch.randint(1, RANK + 1, (f.rows,), generator=g),
                torch.randint(1, RANK + 1, (f.rows,), generator=g),
            )
    return layer


def path_a(layer: LayerKV, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Today's read: dense K/V rebuilt by ``attention_kv`` (``LowRank.fill``, linked rotation), then the
    paged reference over that copy as a pool (holes ``-1``)."""
    n = layer.max_length
    k, v = layer.attention_kv(n)
    b = k.shape[0]
    pool_k = k.permute(1, 0, 2, 3).reshape(H, b * n, D)
    pool_v = v.permute(1, 0, 2, 3).reshape(H, b * n, D)
    table = (torch.arange(b)[:, None, None] * n + torch.arange(n)).expand(b, H, n)
    table = table.masked_fill(~layer.open_mask(n), -1)
    lengths = layer.lengths[:, None].expand(b, H)
    return paged_attention_reference(q, pool_k, pool_v, table, lengths, scale)


def as_rows(rope: dict) -> dict:
    """The references' row form of the builder's table form (``rot`` positions; M-RoPE: ``sec``)."""
    if "sec" not in rope:  # 1-D: a position is the table's row
        return rope
    rows, cos, sin = table_as_rows(rope["rot"], RopeTable(rope["cos"], rope["sin"], rope["sec"]))
    return {"rot": rows, "cos": cos, "sin": sin}


@pytest.fixture(scope="module")
def ropes(engines):
    return {p: engines[name].rope for p, name in MODELS.items()}


@pytest.mark.parametrize("queries", [1, 2], ids=["decode", "chunk2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pos_dims", [1, 3], ids=["rope-1d", "mrope"])
def test_the_paged_factor_read_equals_path_a(ropes, pos_dims, dtype, queries):
    layer = build_layer(ropes[pos_dims], pos_dims, dtype)
    table, lengths, attended, rope, _, factors = paged_lowrank_tables(layer)
    # the table form: rows by position (no row per rotated entry), M-RoPE with its sections
    assert rope["cos"].shape[0] >= 4096 and ("sec" in rope) == (pos_dims > 1)
    assert rope["rot"].shape == (*table.shape, pos_dims)[: 3 if pos_dims == 1 else 4]
    rope = as_rows(rope)
    fac = factors.frow >= 0
    # every kind of column is there: factored (two samples), holes, linked pre-RoPE, dense
    assert bool(fac[0].any()) and bool(fac[2].any()) and not bool(fac[1].any())
    assert bool(layer.holes.any()) and bool(((rope["rot"] >= 0) & ~fac).any())
    assert bool((table >= 0).any())
    assert int(factors.rank_k.min()) < RANK and int(factors.rank_v.min()) < RANK
    # entries attended per sample (mean over heads): every held column, factored ones included
    held = ((table >= 0) | fac) & (torch.arange(table.shape[2]) < lengths[..., None])
    assert torch.equal(attended, held.double().sum(2).mean(1))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(len(LENGTHS), 4, queries, D, generator=g).to(dtype)
    scale = D**-0.5
    pool = layer.pool
    got = paged_lowrank_reference(q, pool.keys[0], pool.values[0], table, lengths, scale, factors, **rope)
    want = path_a(layer, q, scale)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    # the factored columns matter: read as holes, the result differs
    skip = paged_attention_reference(q, pool.keys[0], pool.values[0], table, lengths, scale, **rope)
    assert (skip.float() - want.float()).abs().max() > 10 * atol


# path (b) against the eager rank-space read: both compute in float32 from the stored values, the
# same sums in another order ((q·D_kᵀ)·K̄ᵀ against q·(K̄·D_k)ᵀ) and the output rounded to q's dtype:
# the paged read's tolerances
POST_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pos_dims", [1, 3], ids=["rope-1d", "mrope"])
def test_post_rope_factors_read_paged_equal_the_rank_space_read(ropes, pos_dims, dtype):
    """Path (b) in both factored samples: the builder flags them (their factored columns rotate by no
    ``rot`` entry, linked entries still do) and the paged reference equals ``_rank_space_one_row`` (a
    decode row: the eager read of post-RoPE factors), its output and probabilities."""
    layer = build_layer(ropes[pos_dims], pos_dims, dtype, post=(0, 2))
    assert layer.lowrank.post_rope
    table, lengths, _, rope, _, factors = paged_lowrank_tables(layer)
    assert factors.post_rope.tolist() == [True, False, True]
    fac = factors.frow >= 0
    assert bool(fac[0].any()) and bool(fac[2].any())
    rope = as_rows(rope)
    assert not bool((rope["rot"] >= 0)[fac].any()) and bool((rope["rot"] >= 0).any())  # linked only
    g = torch.Generator().manual_seed(6)
    q = torch.randn(len(LENGTHS), 4, 1, D, generator=g).to(dtype)
    scale = D**-0.5
    pool = layer.pool
    got = paged_lowrank_reference(q, pool.keys[0], pool.values[0], table, lengths, scale, factors, **rope)
    n = layer.max_length
    k, v = layer.attention_kv(n, fill=False)
    want, probs, _ = _rank_space_one_row(q, k, v, scale, layer.lengths - 1, layer.open_mask(n), layer)
    rtol, atol = POST_TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    # the same keys: the reference's softmax is the eager read's probabilities
    kk, _, vis = paged_lowrank_kv(q, pool.keys[0], pool.values[0], table, lengths, factors, **rope)
    scores = torch.matmul(q.float().view(len(LENGTHS), H, 2, D), kk.float().transpose(-1, -2)) * scale
    mine = torch.softmax(scores.masked_fill(~vis, float("-inf")), -1)
    torch.testing.assert_close(mine, probs[..., : mine.shape[-1]], rtol=rtol, atol=atol)


@pytest.mark.parametrize("pos_dims", [1, 3], ids=["rope-1d", "mrope"])
def test_a_batch_mixing_path_a_and_b_reads_each_its_own_way(ropes, pos_dims):
    """Sample 0 post-RoPE (path (b)), sample 2 pre-RoPE (path (a)): one table build, one read, equal to
    the dense rebuild (``LowRank.fill`` rotates sample 2's rows only), fp32."""
    layer = build_layer(ropes[pos_dims], pos_dims, torch.float32, post=(0,))
    assert not layer.lowrank.post_rope  # the eager rank-space read does not apply to a mixed batch
    table, lengths, _, rope, _, factors = paged_lowrank_tables(layer)
    assert factors.post_rope.tolist() == [True, False, False]
    g = torch.Generator().manual_seed(7)
    q = torch.randn(len(LENGTHS), 4, 1, D, generator=g)
    pool = layer.pool
    rope = as_rows(rope)
    fac = factors.frow >= 0
    assert not bool((rope["rot"][0] >= 0)[fac[0]].any()) and bool((rope["rot"][2] >= 0)[fac[2]].any())
    got = paged_lowrank_reference(q, pool.keys[0], pool.values[0], table, lengths, D**-0.5, factors, **rope)
    torch.testing.assert_close(got, path_a(layer, q, D**-0.5), rtol=1e-5, atol=1e-5)


def test_a_layer_without_factors_reads_the_plain_tables(ropes):
    layer = LayerKV.empty(2, H, D, 1, torch.float32, "cpu")
    layer.pool.rope = ropes[1]
    layer.append(
        torch.randn(2, H, 4, D),
        torch.randn(2, H, 4, D),
        torch.arange(4)[None, :, None].expand(2, 4, 1),
        torch.zeros(2, 4, dtype=torch.int8),
        torch.tensor([4, 3]),
    )
    table, lengths, _, rope, host, factors = paged_lowrank_tables(layer)
    assert factors is None and rope == {} and host.lengths == [[4, 4], [3, 3]]
    assert torch.equal(table[1, :, :3], layer.slots[1, :, :3])


@pytest.mark.parametrize("pos_dims", [1, 3], ids=["rope-1d", "mrope"])
def test_the_table_build_reads_nothing_back(ropes, pos_dims):
    """With pre-RoPE factored columns and linked entries the builder takes the rotary table form: no
    sync; the plain build of the same layer reads nothing back with 1-D RoPE either."""
    layer = build_layer(ropes[pos_dims], pos_dims, torch.float32)
    paged_lowrank_tables(layer)  # the rotary table built once (a grown table is a one-time cost)
    with count_ops() as c:
        _, _, _, rope, _, factors = paged_lowrank_tables(layer)
    assert factors is not None and rope["rot"].shape[:3] == factors.frow.shape
    assert c.syncs == 0, dict(c.sites)
    with count_ops() as plain:
        paged_tables(layer)
    # the plain build rotates linked entries by position too; M-RoPE's rows (the rotated columns only)
    # are found by mask (``kv/paged.rope_by_position``)
    assert plain.syncs == (0 if pos_dims == 1 else 2), dict(plain.sites)


def test_a_layer_whose_factors_were_all_pruned_reads_the_plain_tables(ropes):
    layer = build_layer(ropes[1], 1, torch.float32)
    want = paged_tables(layer)
    layer.lowrank.samples = [None] * len(layer.lowrank.samples)  # what LowRank.prune may leave
    table, lengths, attended, rope, host, factors = paged_lowrank_tables(layer)
    assert factors is None
    assert torch.equal(table, want[0]) and torch.equal(lengths, want[1]) and host == want[4]
    assert rope.keys() == want[3].keys() and all(torch.equal(rope[k], want[3][k]) for k in rope)
    with pytest.raises(ValueError, match="no sample holds factors"):
        stack_factors([None, None], table, torch.float32)
