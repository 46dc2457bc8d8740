"""The decode-step fast paths of the cache equal the general ones they stand in for."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import vlkv.runtime.kv.drops as drops
import vlkv.runtime.kv.packing as packing
from vlkv.runtime.cache import LayerKV

B, H, D, P = 3, 2, 8, 3


def _unpacked(select, *args, **kwargs) -> None:
    """``select(*args, **kwargs)`` without packing (``kv.packing``): the general path these decode-time
    paths (which never pack) keep the same slots as."""
    pack, packing.PACK = packing.PACK, False
    try:
        select(*args, **kwargs)
    finally:
        packing.PACK = pack


def _layer(seed: int, lengths: tuple[int, ...] = (5, 2, 7)) -> LayerKV:
    """A layer holding a prefill of ``lengths`` (ragged by default) and a policy score, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    layer = LayerKV.empty(B, H, D, P, torch.float32, "cpu")
    q = 7
    layer.append(
        torch.randn(B, H, q, D, generator=g),
        torch.randn(B, H, q, D, generator=g),
        torch.randint(0, 50, (B, q, P), generator=g),
        torch.randint(0, 3, (B, q), generator=g).to(torch.int8),
        torch.tensor(lengths),
    )
    layer.scores["s"] = torch.rand(B, H, layer.capacity, generator=g)
    return layer


@pytest.mark.parametrize("lengths", [(5, 2, 7), (7, 7, 7)])  # ragged: indexed writes; in step: one column
@pytest.mark.parametrize("steps", [1, 9])
def test_one_row_append_equals_general_append(steps, lengths):
    fast, slow = _layer(0, lengths), _layer(0, lengths)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        pos, mod = torch.randint(0, 99, (B, 1, P), generator=g), torch.full((B, 1), 3, dtype=torch.int8)
        ones = torch.ones(B, dtype=torch.long)
        got = fast.append(k, v, pos, mod, ones)  # order=None: the one-row path
        want = slow.append(k, v, pos, mod, ones, order=slow.next_order[:, None].clone())  # general path
        assert torch.equal(got, want)
    assert torch.equal(fast.lengths, slow.lengths) and torch.equal(fast.next_order, slow.next_order)
    n = int(fast.lengths.max())
    valid = fast.valid_mask()[:, None, :n]
    for name in ("slots", "order", "modality"):
        a, b = getattr(fast, name)[:, :, :n], getattr(slow, name)[:, :, :n]
        assert torch.equal(a[valid.expand_as(a)], b[valid.expand_as(b)]), name
    pv = valid[..., None].expand(B, H, n, P)
    assert torch.equal(fast.positions[:, :, :n][pv], slow.positions[:, :, :n][pv])
    sv = valid.expand(B, H, n)
    assert torch.equal(fast.scores["s"][:, :, :n][sv], slow.scores["s"][:, :, :n][sv])
    for a, b in zip(fast.attention_kv(), slow.attention_kv()):
        assert torch.equal(a[valid[..., None].expand_as(a)], b[valid[..., None].expand_as(b)])


def test_append_returns_lengths_the_cache_does_not_alias():
    layer = _layer(2)
    past = layer.append(
        torch.randn(B, H, 1, D),
        torch.randn(B, H, 1, D),
        torch.zeros(B, 1, P, dtype=torch.long),
        torch.zeros(B, 1, dtype=torch.int8),
        torch.ones(B, dtype=torch.long),
    )
    before = past.clone()
    layer.lengths[0] += 4  # e.g. a link writes into sample 0
    assert torch.equal(past, before) and past.tolist() == [5, 2, 7]


def test_pool_read_equals_advanced_indexing():
    layer = _layer(3)
    pool = layer.pool
    g = torch.Generator().manual_seed(4)
    cap = pool.capacity(0)
    ids = torch.randint(0, cap, (4, H, 81), generator=g)  # repeats and any order
    k, v = pool.read(0, ids)
    heads = torch.arange(H)[None, :, None]
    assert torch.equal(k, pool.keys[0][heads, ids]) and torch.equal(v, pool.values[0][heads, ids])
    assert k.shape == (4, H, 81, D)


def _batch_rows(
    seed: int, lengths: tuple[int, ...] = (5, 2, 7), reserve: int = 0, score: bool = True
) -> list[LayerKV]:
    """Single-sample layers on one growable pool holding ``lengths`` entries (and a score): with
    ``reserve > 0`` each prompt takes a run of slots whose spares its decode appends continue."""
    from vlkv.runtime.cache import private_pool

    g = torch.Generator().manual_seed(seed)
    pool = private_pool(1, H, D, torch.float32, "cpu")
    rows = []
    for n in lengths:
        layer = LayerKV(pool, 0, 1, P)
        layer.run_reserve = reserve
        layer.append(
            torch.randn(1, H, n, D, generator=g),
            torch.randn(1, H, n, D, generator=g),
            torch.randint(0, 50, (1, n, P), generator=g),
            torch.zeros(1, n, dtype=torch.int8),
            torch.tensor([n]),
        )
        if score:
            layer.scores["s"] = torch.rand(1, H, layer.capacity, generator=g)
        rows.append(layer)
    return rows


@pytest.mark.parametrize("steps", [1, 9])
def test_batch_view_one_row_append_equals_per_request_append(steps):
    from vlkv.runtime.kv.batch import LayerBatch

    fast, slow = LayerBatch(_batch_rows(5)), LayerBatch(_batch_rows(5))
    g = torch.Generator().manual_seed(6)
    for _ in range(steps):
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        pos, mod = torch.randint(0, 99, (B, 1, P), generator=g), torch.full((B, 1), 3, dtype=torch.int8)
        ones = torch.ones(B, dtype=torch.long)
        got = fast.append(k, v, pos, mod, ones)  # the batched one-row path
        order = torch.cat([r.next_order for r in slow.rows])[:, None]
        want = slow.append(k, v, pos, mod, ones, order=order)  # per request, general path
        assert torch.equal(got, want)
    for a, b in zip(fast.rows, slow.rows):
        n = int(a.lengths)
        assert n == int(b.lengths) and torch.equal(a.next_order, b.next_order)
        for name in ("slots", "order", "modality", "positions"):
            assert torch.equal(getattr(a, name)[:, :, :n], getattr(b, name)[:, :, :n]), name
        assert torch.equal(a.scores["s"][:, :, :n], b.scores["s"][:, :, :n])
    for x, y in zip(fast.attention_kv(), slow.attention_kv()):
        assert torch.equal(x, y)


def _same_entries(a: LayerKV, b: LayerKV) -> None:
    """Equal tables and K/V over the valid columns of two caches whose samples hold equal lengths."""
    n = int(a.lengths.max())
    assert torch.equal(a.lengths, b.lengths) and int(a.lengths.min()) == n
    assert torch.equal(a.next_order, b.next_order)
    for name in ("order", "modality", "positions"):
        assert torch.equal(getattr(a, name)[:, :, :n], getattr(b, name)[:, :, :n]), name
    for x, y in zip(a.attention_kv(n, view=True), b.attention_kv(n)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("lengths", [(5, 5, 5), (5, 2, 7)])
def test_run_decode_entries_equal_written_ones(lengths):
    """Appends that continue a request's run write its tables at once (nothing is queued for a later
    read): tables, K/V and the batch's read (a gather through the tables) equal a cache without spare
    runs, through in-place edits of the caller's step tensors, explicit orders, a compaction and the
    release."""
    from vlkv.runtime.kv.batch import LayerBatch

    fast = LayerBatch(_batch_rows(7, lengths, reserve=16, score=False))
    slow = LayerBatch(_batch_rows(7, lengths, score=False))
    g = torch.Generator().manual_seed(8)
    for step in range(12):
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        pos, mod = torch.randint(0, 99, (B, 1, P), generator=g), torch.full((B, 1), 3, dtype=torch.int8)
        order = None if step % 4 != 3 else torch.tensor([[40 + step], [3], [90]])  # a link step's indices
        ones = torch.ones(B, dtype=torch.long)
        assert torch.equal(fast.append(k, v, pos, mod, ones, order), slow.append(k, v, pos, mod, ones, order))
        versions = [(r.slots._version, r.positions._version) for r in fast.rows]
        for a, b in zip(fast.rows, slow.rows):  # written by the append, before any K/V read
            _same_entries(a, b)
        pos += 1000  # the caller advances its tensors in place (``next_position += 1``)
        mod.fill_(0)
        kf, vf = fast.attention_kv(view=True)
        ks, vs = slow.attention_kv()
        valid = slow.valid_mask()[:, None, :, None].expand_as(ks)
        assert torch.equal(kf[valid], ks[valid]) and torch.equal(vf[valid], vs[valid])
        # reads write nothing: the tables are the same tensors at the same versions
        assert versions == [(r.slots._version, r.positions._version) for r in fast.rows]
    for r in fast.rows:  # each request's slots are still its run
        start, n = int(r.slots[0, 0, 0]), int(r.lengths)
        assert torch.equal(r.slots[0, :, :n], torch.arange(start, start + n).expand(H, n))
        assert r.run_start(n) == start
    for a, b in zip(fast.rows, slow.rows):
        _same_entries(a, b)
    # append again, then let the pool compact (the tables and the spares follow it)
    k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
    pos, mod = torch.randint(0, 99, (B, 1, P), generator=g), torch.full((B, 1), 3, dtype=torch.int8)
    for view in (fast, slow):
        view.append(k, v, pos, mod, torch.ones(B, dtype=torch.long))
    fast.rows[1].release()
    slow.rows[1].release()
    fast.pool.compact(0)
    for i in (0, 2):
        _same_entries(fast.rows[i], slow.rows[i])
    for r in (fast.rows[0], fast.rows[2]):
        r.release()
    assert fast.pool.used_slots(0) == 0


def _drop_three(layer: LayerKV, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """An eviction of 3 random columns per head: ``index (1, H, n - 2)`` (one padding column),
    ``keep_len (1,)`` and the dropped slots ``(H, 3)`` ascending by column."""
    n = int(layer.lengths)
    drop = torch.stack([torch.randperm(n, generator=g)[:3].sort().values for _ in range(H)])  # (H, 3)
    keep = torch.ones(H, n, dtype=torch.bool).scatter_(1, drop, False)
    index = torch.stack([torch.nonzero(row).squeeze(1) for row in keep])[None]  # (1, H, n - 3)
    index = torch.cat([index, index[:, :, :1]], 2)  # a padding column past keep_len
    return index, torch.tensor([n - 3]), layer.slots[0].gather(1, drop)


def test_one_sample_select_equals_the_general_select():
    """The one-sample eviction path (no holes, no factors) keeps what the general path does (tables,
    K/V, scores); the few slots it drops become its next spares where the general path frees them,
    and the next appends take them (an all-False ``holes`` takes the general path)."""
    g = torch.Generator().manual_seed(9)
    fast, slow = _batch_rows(3, (9,), reserve=4)[0], _batch_rows(3, (9,), reserve=4)[0]
    free = fast.pool.free_slots(0)
    for spare in (0, 2):
        index, keep_len, dropped = _drop_three(fast, g)
        held = fast.spare_ids
        fast.select(index, keep_len, spare=spare, recycle=True)
        _unpacked(
            slow.select,
            index,
            keep_len,
            spare=spare,
            holes=torch.zeros(1, H, index.shape[2], dtype=torch.bool),
        )
        assert slow.pool.free_slots(0) == free + 3 * (1 + (spare == 2))
        assert fast.pool.free_slots(0) == free  # recycled, not freed
        assert torch.equal(fast.spare_ids, torch.cat([dropped, held], 1))  # the dropped ones first
        k = int(keep_len)  # past it the columns are room for appends: their content is no entry's
        assert torch.equal(fast.slots[:, :, :k], slow.slots[:, :, :k]) and fast.capacity >= k + spare
        _same_entries(fast, slow)
        assert torch.equal(fast.scores["s"][:, :, :k], slow.scores["s"][:, :, :k]) and slow.holes is None
    # the next three decode appends write the recycled slots (newest drop first), then the run's spares
    k, v = torch.randn(1, H, 4, D, generator=g), torch.randn(1, H, 4, D, generator=g)
    want = fast.spare_ids[:, :4].clone()
    for t in range(4):
        fast.append(
            k[:, :, t : t + 1],
            v[:, :, t : t + 1],
            torch.zeros(1, 1, P, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.int8),
            torch.ones(1, dtype=torch.long),
        )
    n = int(fast.lengths)
    assert torch.equal(fast.slots[0, :, n - 4 : n], want) and fast.pool.free_slots(0) == free
    got_k, got_v = fast.attention_kv(n)
    assert torch.equal(got_k[0, :, n - 4 :], k[0]) and torch.equal(got_v[0, :, n - 4 :], v[0])
    fast.release()
    assert fast.pool.used_slots(0) == 0


def test_shared_or_many_dropped_slots_go_back_to_the_pool():
    """Recycling is for the few slots only this cache holds: a drop that includes a slot another
    holder references, or more than ``RECYCLE_MAX`` per head, is released as before."""
    from vlkv.runtime.cache import RECYCLE_MAX

    g = torch.Generator().manual_seed(11)
    layer = _batch_rows(3, (9,))[0]
    index, keep_len, dropped = _drop_three(layer, g)
    layer.pool.retain(0, torch.tensor([0]), dropped[0, :1])  # a second holder of one dropped slot

    def held(pool) -> int:  # referenced (head, slot) pairs, summed over heads
        return int((pool._refs[0] > 0).sum())

    before = held(layer.pool)
    layer.select(index, keep_len, recycle=True)
    assert layer.spare_ids is None and held(layer.pool) == before - (3 * H - 1)
    big = _batch_rows(3, (RECYCLE_MAX + 9,))[0]
    before, n = held(big.pool), int(big.lengths)
    big.select(torch.arange(8).expand(1, H, 8), torch.tensor([8]), recycle=True)
    assert big.spare_ids is None and held(big.pool) == before - H * (n - 8)


def test_a_batch_eviction_recycles_its_slots_into_the_next_appends():
    """A batch moving in step (equal lengths, equal keep) takes the uniform path: the same tables and
    K/V as the general path; its dropped slots are held (``recycled``, counted in ``spare_bytes``) and
    the next decode appends write them, one per sample and head; a compaction follows them and a
    release frees them."""
    g = torch.Generator().manual_seed(12)
    n = 7
    fast, slow = _layer(13, (n,) * B), _layer(13, (n,) * B)
    drop = torch.stack(
        [torch.stack([torch.randperm(n, generator=g)[:2] for _ in range(H)]) for _ in range(B)]
    )
    keep = torch.ones(B, H, n, dtype=torch.bool).scatter_(2, drop, False)
    index = torch.stack([torch.stack([torch.nonzero(r).squeeze(1) for r in s]) for s in keep])  # (B, H, 5)
    keep_len = torch.full((B,), n - 2)
    dropped = fast.slots[:, :, :n][~keep].view(B, H, 2)
    fast.select(index, keep_len, spare=2, recycle=True)
    _unpacked(slow.select, index, keep_len, spare=2, holes=torch.zeros(B, H, n - 2, dtype=torch.bool))
    assert torch.equal(fast.recycled, dropped.permute(1, 0, 2)) and fast.spare_ids is None
    assert fast.spare_bytes() == 2 * B * fast.pool.spec.entry_bytes
    _same_entries(fast, slow)
    assert torch.equal(fast.scores["s"][:, :, : n - 2], slow.scores["s"][:, :, : n - 2])
    free = fast.pool.free_slots(0)
    k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
    pos, mod = torch.zeros(B, 1, P, dtype=torch.long), torch.zeros(B, 1, dtype=torch.int8)
    fast.append(k, v, pos, mod, torch.ones(B, dtype=torch.long))
    slow.append(k, v, pos, mod, torch.ones(B, dtype=torch.long))
    assert fast.pool.free_slots(0) == free  # no allocation: the first recycled column was written
    assert torch.equal(fast.slots[:, :, n - 2], dropped[:, :, 0])
    _same_entries(fast, slow)
    assert torch.equal(fast.recycled, dropped.permute(1, 0, 2)[:, :, 1:])
    fast.pool.compact(0)  # the held recycled slots follow the compaction
    k2, v2 = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
    fast.append(k2, v2, pos, mod, torch.ones(B, dtype=torch.long))
    slow.append(k2, v2, pos, mod, torch.ones(B, dtype=torch.long))
    _same_entries(fast, slow)
    assert fast.recycled is None and fast.spare_bytes() == 0
    fast.append(k2, v2, pos, mod, torch.ones(B, dtype=torch.long))  # none left: the pool allocates
    fast.release()
    assert fast.pool.used_slots(0) == 0


def _cut_as_select(layer: LayerKV, start: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """The general edit a cut stands for: ``index (B, H, K)`` skipping each sample's run, ``keep_len``."""
    keep_len = layer.lengths - count
    j = torch.arange(int(keep_len.max()))[None, :]
    index = (j + (j >= start[:, None]).long() * count[:, None]).clamp(max=int(layer.lengths.max()) - 1)
    return index[:, None].expand(-1, H, -1).contiguous(), keep_len


def _same_valid(a: LayerKV, b: LayerKV) -> None:
    """Equal lengths, tables, scores and K/V over each sample's valid columns (ragged allowed)."""
    assert torch.equal(a.lengths, b.lengths) and torch.equal(a.next_order, b.next_order)
    n = int(a.lengths.max())
    valid = a.valid_mask(n)[:, None, :].expand(a.batch, H, n)
    for name in ("slots", "order", "modality"):
        assert torch.equal(getattr(a, name)[:, :, :n][valid], getattr(b, name)[:, :, :n][valid]), name
    assert torch.equal(a.positions[:, :, :n][valid], b.positions[:, :, :n][valid])
    for s in a.scores:
        assert torch.equal(a.scores[s][:, :, :n][valid], b.scores[s][:, :, :n][valid]), s
    for x, y in zip(a.attention_kv(n), b.attention_kv(n)):
        assert torch.equal(x[valid], y[valid])


@pytest.mark.parametrize(
    ("lengths", "start", "count"),
    [
        ((7, 7, 7), (3, 3, 3), (1, 1, 1)),  # a batch moving in step: one slice per table, recycled
        ((7, 7, 7), (6, 6, 6), (1, 1, 1)),  # the last entry: nothing moves
        ((5, 2, 7), (1, 0, 4), (2, 0, 3)),  # ragged, one sample left alone: per-sample slices, freed
    ],
)
def test_a_cut_equals_the_select_it_stands_for(lengths, start, count):
    """:meth:`LayerKV.cut` keeps what a select skipping each sample's run keeps (tables, scores,
    K/V), holds or frees the same slots, and the next decode append lands after the moved entries."""
    start, count = torch.tensor(start), torch.tensor(count)
    fast, slow = _layer(14, lengths), _layer(14, lengths)
    dropped = [
        fast.slots[b, :, s : s + c].clone() for b, (s, c) in enumerate(zip(start.tolist(), count.tolist()))
    ]
    free = fast.pool.free_slots(0)
    fast.cut(start, count, recycle=True)
    index, keep_len = _cut_as_select(slow, start, count)
    _unpacked(slow.select, index, keep_len, holes=torch.zeros(index.shape, dtype=torch.bool))
    _same_valid(fast, slow)
    if len(set(lengths)) == 1:  # cut alike: the dropped slots wait for the next appends
        assert torch.equal(fast.recycled, torch.stack(dropped).permute(1, 0, 2))
        assert fast.pool.free_slots(0) == free
    else:
        assert fast.recycled is None and fast.pool.free_slots(0) == slow.pool.free_slots(0)
    g = torch.Generator().manual_seed(15)
    k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
    pos, mod = torch.zeros(B, 1, P, dtype=torch.long), torch.zeros(B, 1, dtype=torch.int8)
    for layer in (fast, slow):
        layer.append(k, v, pos, mod, torch.ones(B, dtype=torch.long))
    _same_valid(fast, slow)
    fast.release()
    assert fast.pool.used_slots(0) == 0


def test_a_cut_of_run_entries_and_of_a_cache_with_holes():
    """A cut of a one-sample run's decode entries (the cut entry is one of them) equals the select it
    stands for; a cache with per-head holes takes the general select; a cut past a sample's entries
    names the layer and the sample."""
    fast, slow = (
        _batch_rows(16, (6,), reserve=8, score=False)[0],
        _batch_rows(16, (6,), reserve=8, score=False)[0],
    )
    g = torch.Generator().manual_seed(17)
    for _ in range(3):
        k, v = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
        pos, mod = torch.randint(0, 99, (1, 1, P), generator=g), torch.zeros(1, 1, dtype=torch.int8)
        for layer in (fast, slow):
            layer.append(k, v, pos, mod, torch.ones(1, dtype=torch.long))
        fast.attention_kv(view=True)  # a backend's read: a view of the run
    assert fast.run_start(9) == int(fast.slots[0, 0, 0])  # prompt and decode entries: one run
    start, count = torch.tensor([7]), torch.tensor([1])
    fast.cut(start, count, recycle=True)
    index, keep_len = _cut_as_select(slow, start, count)
    _unpacked(slow.select, index, keep_len)
    _same_valid(fast, slow)

    holed, plain = _layer(18, (7, 7, 7)), _layer(18, (7, 7, 7))
    punch = torch.zeros(B, H, 7, dtype=torch.bool)
    punch[1, 0, 2] = True
    for layer in (holed, plain):
        layer.select(torch.arange(7).expand(B, H, 7), torch.full((B,), 7), holes=punch)
    start, count = torch.tensor([2, 4, 0]), torch.tensor([2, 1, 0])
    holed.cut(start, count)
    _unpacked(plain.select, *_cut_as_select(plain, start, count))
    assert torch.equal(holed.holes[:, :, :6], plain.holes[:, :, :6])
    _same_valid(holed, plain)
    with pytest.raises(ValueError, match="layer 0: cut of 3 entries at column 5 of sample 1"):
        holed.cut(torch.tensor([0, 5, 0]), torch.tensor([0, 3, 0]))


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("near_end", [True, False])
def test_a_decode_eviction_near_the_end_rewrites_the_tables_in_place(near_end, in_place, monkeypatch):
    """A decode-time drop of one entry per row rewrites the tables in place from the first column any
    row drops, wherever it sits (the same tensors). Without that path (``IN_PLACE`` off) the tables
    are rebuilt. Both keep what the general path keeps, and the next append lands after the kept
    entries."""
    monkeypatch.setattr(drops, "IN_PLACE", in_place)
    g = torch.Generator().manual_seed(19)
    n = 7
    fast, slow = _layer(20, (n,) * B), _layer(20, (n,) * B)
    lo = n - 1 if near_end else 0
    drop = torch.randint(lo, n, (B, H, 1), generator=g)
    keep = torch.ones(B, H, n, dtype=torch.bool).scatter_(2, drop, False)
    index = torch.nonzero(keep)[:, 2].view(B, H, n - 1)
    before = fast.slots
    fast.select(index, torch.full((B,), n - 1), spare=1, recycle=True)
    _unpacked(
        slow.select, index, torch.full((B,), n - 1), spare=1, holes=torch.zeros(B, H, n - 1, dtype=torch.bool)
    )
    assert (fast.slots is before) == in_place
    _same_valid(fast, slow)
    k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
    pos, mod = torch.zeros(B, 1, P, dtype=torch.long), torch.zeros(B, 1, dtype=torch.int8)
    for layer in (fast, slow):
        layer.append(k, v, pos, mod, torch.ones(B, dtype=torch.long))
    _same_valid(fast, slow)


def test_a_full_fixed_pool_keeps_the_spares_a_decode_append_took():
    """A batch view's decode append on a fixed pool: one row continues its held spares, the other needs
    a fresh slot and the pool has none. ``PoolFull`` propagates, nothing is appended, and the first
    row's spares are still held (taken, then lost, they were referenced slots nobody could release);
    with a slot freed the append then takes the same spare."""
    from vlkv.runtime.kv.appends import append_one_each
    from vlkv.runtime.kv.pool import KVPool, PoolFull, PoolSpec

    spec = PoolSpec(num_layers=1, kv_heads=H, head_dim=D, dtype=torch.float32, device="cpu")
    pool = KVPool(spec, 8, grow=False)
    rows = [LayerKV(pool, 0, 1, P) for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    for r in rows:
        r.append(
            torch.randn(1, H, 2, D, generator=g),
            torch.randn(1, H, 2, D, generator=g),
            torch.zeros(1, 2, P, dtype=torch.long),
            torch.zeros(1, 2, dtype=torch.int8),
            torch.tensor([2]),
        )
    rows[0].spares.hold_run(pool.alloc(0, 2), None)  # two held spares (not one run: tensor ids)
    filler = pool.alloc(0, pool.free_slots(0))  # the pool is full
    held, used = rows[0].spare_ids.clone(), pool.used_slots(0)
    k, v = torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g)
    args = ([torch.zeros(P, dtype=torch.long)] * 2, [3, 3], [None, None])
    with pytest.raises(PoolFull):
        append_one_each(rows, k, v, *args)
    assert torch.equal(rows[0].spare_ids, held) and pool.used_slots(0) == used
    assert [r.host_lengths() for r in rows] == [[2], [2]]
    pool.release(0, filler[:, :1])
    append_one_each(rows, k, v, *args)
    assert torch.equal(rows[0].slots[0, :, 2], held[:, 0]) and rows[0].spare_ids.shape[1] == 1
    for r in rows:
        r.release()
    pool.release(0, filler[:, 1:])
    assert pool.used_slots(0) == 0
