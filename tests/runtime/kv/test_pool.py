"""The slot pool: allocation, reuse, fixed-size refusal, compaction and byte accounting."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.cache import KVCache
from vlkv.runtime.kv import KVPool, PoolFull, PoolSpec
from vlkv.runtime.kv.pool import COMPACT_MIN_SLOTS

SPEC = PoolSpec(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")


def _storage(pool: KVPool) -> int:
    return sum(t.untyped_storage().nbytes() for t in (*pool.keys, *pool.values))


def _fill(cache: KVCache, n: int, seed: int = 0) -> torch.Tensor:
    """Append ``n`` random entries to every layer of a one-sample cache; returns the keys ``(1, H, n, D)``."""
    k = torch.randn(1, SPEC.kv_heads, n, SPEC.head_dim, generator=torch.Generator().manual_seed(seed))
    for layer in cache.layers:
        layer.append(
            k, -k, torch.arange(n)[None, :, None], torch.zeros(1, n, dtype=torch.int8), torch.tensor([n])
        )
    return k


def test_freed_slots_are_reused_by_the_next_write():
    pool = KVPool(SPEC, 16, grow=False)
    a = KVCache.empty(2, 1, 2, 4, 1, torch.float32, pool=pool)
    _fill(a, 6)
    layer = a.layers[0]
    # keep entries 0, 2, 4 in head 0 and 1, 3, 5 in head 1: three slots per head come free
    layer.select(torch.tensor([[[0, 2, 4], [1, 3, 5]]]), torch.tensor([3]))
    # the kept entries may have moved (packed into the lowest slots, ``kv.packing``): the freed are
    # the first six ids less the kept ones
    freed = {h: set(range(6)) - set(layer.slots[0, h, :3].tolist()) for h in range(2)}
    assert pool.free_slots(0) == 16 - 3
    b = KVCache.empty(2, 1, 2, 4, 1, torch.float32, pool=pool)
    _fill(b, 3, seed=1)
    for h in range(2):
        assert set(b.layers[0].slots[0, h, :3].tolist()) == freed[h]  # holes first, not the unused tail
    assert pool.used_bytes() == a.kv_bytes() + b.kv_bytes()


def test_a_fixed_pool_refuses_a_write_past_its_slots():
    pool = KVPool.with_bytes(SPEC, 5 * SPEC.entry_bytes * SPEC.num_layers)
    cache = KVCache.empty(2, 1, 2, 4, 1, torch.float32, pool=pool)
    _fill(cache, 5)
    with pytest.raises(PoolFull, match="layer 0 has 0 free slots of 5, needs 1"):
        _fill(cache, 1)
    with pytest.raises(ValueError, match="holds no token"):
        KVPool.with_bytes(SPEC, 10)


def test_eviction_writes_no_kv_and_release_frees_everything():
    pool = KVPool(SPEC, 0, grow=True)
    cache = KVCache.empty(2, 1, 2, 4, 1, torch.float32, pool=pool)
    _fill(cache, 10)
    written = pool.bytes_written
    assert written == 10 * SPEC.entry_bytes * SPEC.num_layers
    for layer in cache.layers:
        layer.select(torch.tensor([[[0, 5, 9], [1, 2, 3]]]), torch.tensor([3]))
    assert pool.bytes_written == written  # survivors never move
    assert pool.used_bytes() == cache.kv_bytes() == 3 * SPEC.entry_bytes * SPEC.num_layers
    cache.release()
    assert pool.used_bytes() == 0 and cache.kv_bytes() == 0


def test_a_double_release_raises_and_leaves_every_refcount_intact():
    pool = KVPool(SPEC, 8, grow=False)
    ids = pool.alloc(0, 3)  # (H_kv, 3): one reference each
    pool.retain(0, torch.arange(2)[:, None].expand(2, 1).reshape(-1), ids[:, :1].reshape(-1))  # slot 0: two
    refs, free = pool._refs[0].clone(), pool.free_slots(0)
    pool.release(0, ids[:, 1:2])  # slot 1 back to the pool
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(0, ids[:, 1:2])  # already free
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(0, torch.cat([ids[:, 2:3]] * 2, dim=1))  # held once, named twice in one call
    want = refs.clone()
    want[torch.arange(2), ids[:, 1]] = 0
    assert torch.equal(pool._refs[0], want) and pool.free_slots(0) == free + 1
    pool.release(0, ids[:, :1])
    pool.release(0, ids[:, :1])  # slot 0 held twice: two releases are fine
    pool.release(0, ids[:, 2:3])
    assert pool.free_slots(0) == 8 and int(pool._refs[0].sum()) == 0


def test_compaction_remaps_tables_keeps_contents_and_shrinks_the_pool():
    pool = KVPool(SPEC, 0, grow=True)
    cache = KVCache.empty(2, 1, 2, 4, 1, torch.float32, pool=pool)
    n = 2 * COMPACT_MIN_SLOTS
    k = _fill(cache, n)
    held = pool.held_bytes()
    keep = torch.arange(n - 40, n)  # the newest 40 entries live in the highest slots
    index = torch.stack([keep, keep - 1])[None]
    cache.layers[0].select(index, torch.tensor([40]))
    assert pool.compactions == 1
    assert pool.capacity(0) < n / 4 and pool.capacity(1) == n  # only the edited layer shrank
    assert pool.held_bytes() < held and pool.held_bytes() == _storage(pool)
    # the same keys, read through the remapped table
    got = cache.layers[0].attention_kv()[0]
    want = torch.stack([k[0, 0, keep], k[0, 1, keep - 1]])[None]
    assert torch.equal(got, want)
    assert int(cache.layers[0].slots.max()) < pool.capacity(0)
    # layer 1 was untouched
    assert torch.equal(cache.layers[1].attention_kv()[0], k)


def test_offload_and_reload_are_bit_identical():
    pool = KVPool(SPEC, 16, grow=False)
    cache = KVCache.empty(2, 1, 2, 4, 1, torch.float32, pool=pool)
    _fill(cache, 7)
    cache.layers[1].select(torch.tensor([[[0, 3, 6], [2, 4, 5]]]), torch.tensor([3]))
    before = [layer.attention_kv() for layer in cache.layers]
    cache.offload()
    assert pool.used_bytes() == 0
    other = KVCache.empty(2, 1, 2, 4, 1, torch.float32, pool=pool)
    _fill(other, 5, seed=3)  # someone else takes the freed slots meanwhile
    cache.reload()
    for (k0, v0), layer in zip(before, cache.layers):
        k1, v1 = layer.attention_kv()
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert pool.used_bytes() == cache.kv_bytes() + other.kv_bytes()


def test_scratch_reads_equal_copies_and_reuse_one_buffer():
    """``read(scratch=True)`` gathers into one reused buffer (a backend's per-layer read); the default
    read is a fresh copy that a later scratch read cannot change."""
    spec = PoolSpec(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    pool = KVPool(spec, 16, grow=False)
    for layer in range(2):
        ids = pool.alloc(layer, 10)
        pool.write(layer, ids, torch.randn(2, 10, 4), torch.randn(2, 10, 4))
    want = torch.tensor([[[3, 1, 7], [0, 9, 2]]])  # (B, H_kv, n), any order
    copy0 = pool.read(0, want)
    k0, v0 = pool.read(0, want, scratch=True)
    assert torch.equal(k0, copy0[0]) and torch.equal(v0, copy0[1])
    k1, _ = pool.read(1, want, scratch=True)
    assert k1.untyped_storage().data_ptr() == k0.untyped_storage().data_ptr()  # the same buffer
    assert torch.equal(k1, pool.read(1, want)[0]) and not torch.equal(copy0[0], k1)
    bigger = torch.arange(10)[None, None].expand(1, 2, 10).contiguous()  # grows the buffer
    torch.testing.assert_close(pool.read(1, bigger, scratch=True)[1], pool.read(1, bigger)[1])


def test_headroom_grows_once_and_survives_compaction():
    spec = PoolSpec(num_layers=1, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    pool = KVPool(spec, 0, grow=True)
    ids = pool.alloc(0, 400)
    pool.ensure_headroom(100)
    assert pool.free_slots(0) >= 100 and pool.capacity(0) == 500
    cap = pool.capacity(0)
    for _ in range(100):  # the appends the headroom was for: no growth
        pool.alloc(0, 1)
    assert pool.capacity(0) == cap
    pool.ensure_headroom(50)
    assert pool.capacity(0) == 550
    pool.release(0, ids[:, :350])  # frees most of the layer: compaction shrinks it, keeping the headroom
    assert pool.compactions == 1 and pool.capacity(0) == 150 + 50 and pool.free_slots(0) == 50


def test_decode_never_grows_the_generate_pool(engines, images, monkeypatch):
    """``Engine.generate`` keeps room for every running request's remaining tokens: the pool grows
    for prompts only, never during decode."""
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.prompt import Prompt

    grows = []
    real = KVPool._grow
    monkeypatch.setattr(
        KVPool, "_grow", lambda self, layer, extra: (grows.append(extra), real(self, layer, extra))
    )
    prompts = [Prompt("Describe it.", [images[0]]), Prompt("A short text prompt.")]
    engine = engines["tiny-llava"]
    engine.generate(prompts, make_policy("full"), 1, stop_at_eos=False)
    one = len(grows)
    grows.clear()
    engine.generate(prompts, make_policy("full"), 40, stop_at_eos=False)
    assert len(grows) == one


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_column_write_equals_the_per_head_write(dtype):
    spec = PoolSpec(num_layers=1, kv_heads=3, head_dim=5, dtype=dtype, device="cpu")
    a, b = KVPool(spec, 12, grow=False), KVPool(spec, 12, grow=False)
    g = torch.Generator().manual_seed(0)
    old = torch.randn(2, 3, 12, 5, generator=g).unbind(0)
    for pool in (a, b):  # same contents, some keys marked pre-RoPE
        pool.write(0, torch.arange(12).expand(3, 12), *old)
        pool.write(0, torch.tensor([[2, 7]]).expand(3, 2), torch.zeros(3, 2, 5), torch.zeros(3, 2, 5), True)
    ids = torch.tensor([7, 0, 11])
    k, v = torch.randn(2, 3, 3, 5, generator=g).unbind(0)  # fp32 in: cast to the pool's dtype
    a.write_columns(0, ids, k.transpose(1, 2).contiguous().transpose(1, 2), v)  # strided source too
    b.write(0, ids.expand(3, 3), k, v)
    assert torch.equal(a.keys[0], b.keys[0]) and torch.equal(a.values[0], b.values[0])
    assert torch.equal(a._prerope[0], b._prerope[0]) and not bool(a._prerope[0][:, 7].any())
    assert bool(a._prerope[0][:, 2].all()) and a.bytes_written == b.bytes_written


@pytest.mark.parametrize("grow", [False, True], ids=["fixed", "grown"])
@pytest.mark.parametrize("ragged", [False, True], ids=["even-heads", "ragged-heads"])
def test_unalloc_takes_back_the_slots_alloc_just_handed_out(grow, ragged):
    """``alloc`` then ``unalloc`` (a decode append whose write failed): the free stacks, free counts and
    references are as before (a growable pool grown for the allocation keeps its new, free slots), and
    the next allocation hands out the same ids. Ragged heads (a shared record's slots freed in one head)
    take ``alloc``'s gather path."""
    pool = KVPool(SPEC, 0 if grow else 16, grow=grow)
    held = pool.alloc(0, 6)
    pool.alloc(0, pool.free_slots(0) - (2 if grow else 6))  # a growable pool: 5 needs more room
    if ragged:
        pool.release(0, torch.tensor([held[0, 1].item()]), heads=torch.tensor([0]))
    free, refs = [list(pool._nfree_host[0])], pool._refs[0].clone()
    ids = pool.alloc(0, 5)  # a growable pool grows for it
    pool.unalloc(0, ids)
    cap = refs.shape[1]
    assert torch.equal(pool._refs[0][:, :cap], refs) and not pool._refs[0][:, cap:].any()
    grown = pool.capacity(0) - cap
    assert grown > 0 if grow else grown == 0
    assert [[f - grown for f in pool._nfree_host[0]]] == free and pool._nfree[0].tolist() == pool._nfree_host[
        0
    ]
    assert torch.equal(pool.alloc(0, 5), ids)


def _state(pool: KVPool) -> list:
    """Every layer's free counts (device and host), stack, refcounts and pre-RoPE flags."""
    return [
        (pool._nfree[i], pool._nfree_host[i], pool._free[i], pool._refs[i], pool._prerope[i])
        for i in range(SPEC.num_layers)
    ]


def _assert_same(a: KVPool, b: KVPool) -> None:
    for la, lb in zip(_state(a), _state(b)):
        for x, y in zip(la, lb):
            assert x == y if isinstance(x, list) else torch.equal(x, y)


def _pair() -> tuple[KVPool, KVPool, list]:
    """Two fixed pools with the same slots taken (every layer and head 6 deep); the first's ids."""
    pools = KVPool(SPEC, 8, grow=False), KVPool(SPEC, 8, grow=False)
    held = [[p.alloc(i, 2) for i in range(SPEC.num_layers)] for p in pools][0]
    return *pools, held


def test_alloc_ahead_hands_every_layer_what_its_own_alloc_would():
    """A fixed pool's allocation over every layer at once (the first alloc after alloc_ahead): each
    layer's alloc of that count gets the slots a per-layer alloc chooses, and the pool ends as after
    per-layer allocs (free counts, stacks, refcounts, flags)."""
    pool, ref, _ = _pair()
    pool.alloc_ahead()
    got = [pool.alloc(i, 3) for i in (1, 0)]  # any layer first
    want = [ref.alloc(i, 3) for i in (1, 0)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not pool._pending
    pool.settle()  # nothing left to take back
    _assert_same(pool, ref)


def test_slots_taken_ahead_but_not_asked_for_go_back():
    """A layer that asks another count than the first gets it from its own stack (the slots taken
    ahead back first), a layer that asks nothing gets its slots back at settle: the pool ends as if
    only those allocs ran."""
    for counts in ((2, 1), (2, None)):
        pool, ref, _ = _pair()
        pool.alloc_ahead()
        for layer, n in enumerate(counts):
            if n is not None:
                assert torch.equal(pool.alloc(layer, n), ref.alloc(layer, n))
        assert pool._pending == {} if counts[1] is not None else set(pool._pending) == {1}
        pool.settle()
        _assert_same(pool, ref)


def test_alloc_ahead_takes_nothing_where_it_does_not_apply():
    """Layers of different depths, a count past the free slots, a growable pool: each alloc as without
    it; freeing slots while some are taken ahead raises before changing anything."""
    pool, ref, held = _pair()
    for p in (pool, ref):
        p.alloc(0, 1)
    pool.alloc_ahead()  # layer 0 is 5 deep, layer 1 is 6
    assert torch.equal(pool.alloc(1, 2), ref.alloc(1, 2))
    assert not pool._pending
    _assert_same(pool, ref)
    pool, _, held = _pair()
    pool.alloc_ahead()
    with pytest.raises(PoolFull):
        pool.alloc(0, 7)
    pool.settle()
    grow = KVPool(SPEC, 8, grow=True)
    grow.alloc_ahead()
    grow.alloc(0, 1)
    assert not grow._pending
    pool.alloc_ahead()
    pool.alloc(0, 1)
    refs = pool._refs[1].clone()
    with pytest.raises(RuntimeError, match="freed between alloc_ahead and settle"):
        pool.release(1, held[1])
    assert torch.equal(pool._refs[1], refs)  # refused before any change
    pool.settle()
    assert pool.free_slots(1) == 6
    pool.release(1, held[1])
    assert pool.free_slots(1) == 8
