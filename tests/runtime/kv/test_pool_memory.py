"""A CPU KV pool's K/V in huge-page-advised memory (``vlkv/runtime/kv/pool_memory.py``).

What must hold: a pool's K/V tensors (fixed pool, and a growable pool after growth and after compaction's
shrink) are advised to huge pages (``hg`` in the mapping's ``VmFlags``) and start on a 2 MiB boundary, for
every dtype the pool holds; where the kernel's THP mode allows it they are really backed by huge pages
(``AnonHugePages``); the off switch (``VLKV_KV_HUGE_PAGES=0`` = ``weight_pages.HUGE_KV``) and
``huge=False`` give ordinary memory; tensors below one huge page and non-CPU pools are never affected;
growth and compaction keep the contents; and a prefill + decode steps give bit-equal logits and K/V with
the pool in huge pages and in ordinary pages.
"""

from __future__ import annotations

import pytest
import torch

from vlkv.plugins import weight_pages
from vlkv.runtime.kv import KVPool, PoolSpec, pool_memory
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

HUGE = 2 << 20
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# the kernel gives huge pages to advised memory in these modes (``never``: advice only, 4 KiB pages)
THP_ON = pool_memory.thp_mode() in ("always", "madvise")


@pytest.fixture(autouse=True)
def _built():
    if weight_pages.kernel() is None:  # a C++ compiler is part of the CPU test environment
        pytest.fail("the huge-page buffer could not be built here")
    if pool_memory.mappings() is None:  # the CPU test environment is Linux
        pytest.fail("/proc/self/smaps cannot be read here")


def _spec(dtype: torch.dtype, layers: int = 2) -> PoolSpec:
    return PoolSpec(num_layers=layers, kv_heads=3, head_dim=64, dtype=dtype, device="cpu")


def _slots_for(dtype: torch.dtype, nbytes: int) -> int:
    """Slots per layer so that one K (or V) tensor holds at least ``nbytes``."""
    return -(-nbytes // (3 * 64 * dtype.itemsize))


def _assert_huge(t: torch.Tensor) -> None:
    assert t.is_contiguous() and t.data_ptr() % HUGE == 0
    assert pool_memory.huge_advised(t) is True
    if THP_ON:  # at least one whole huge page lies inside a tensor of >= 2 MiB that starts on a boundary
        assert pool_memory.huge_backed_bytes(t) >= HUGE


def _assert_ordinary(t: torch.Tensor) -> None:
    assert pool_memory.huge_advised(t) is False
    if pool_memory.thp_mode() == "madvise":  # unadvised memory gets no huge page in this mode
        assert pool_memory.huge_backed_bytes(t) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fixed_pool_kv_is_huge_page_memory_of_every_dtype_and_ordinary_when_off(dtype):
    slots = _slots_for(dtype, 3 * HUGE + 4096)  # a tail short of a huge page too
    on, off = (
        KVPool(_spec(dtype), slots, grow=False, huge=True),
        KVPool(_spec(dtype), slots, grow=False, huge=False),
    )
    assert on.huge and not off.huge
    for t in (*on.keys, *on.values):
        assert t.shape == (3, slots, 64) and t.dtype == dtype
        assert not t.any()  # zeros, as torch.zeros
        _assert_huge(t)
    for t in (*off.keys, *off.values):
        _assert_ordinary(t)
    # the same writes give the same bytes
    ids = torch.arange(0, slots, 7).expand(3, -1).contiguous()
    k = torch.randn(3, ids.shape[1], 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    for pool in (on, off):
        pool.write(1, ids, k, -k)
    assert torch.equal(on.keys[1], off.keys[1]) and torch.equal(on.values[1], off.values[1])
    assert on.held_bytes() == off.held_bytes()


def test_the_switch_sets_a_new_pools_memory_and_each_pool_keeps_its_choice(monkeypatch):
    slots = _slots_for(torch.float32, HUGE)
    monkeypatch.setattr(weight_pages, "HUGE_KV", False)
    off = KVPool(_spec(torch.float32, 1), slots, grow=True)
    monkeypatch.setattr(weight_pages, "HUGE_KV", True)
    on = KVPool.with_bytes(_spec(torch.float32, 1), 2 * 3 * 64 * 4 * slots)
    assert not off.huge and on.huge
    _assert_ordinary(off.keys[0])
    _assert_huge(on.keys[0])
    off.alloc(0, slots + 1)  # growth while the switch is on: the pool keeps its own choice
    _assert_ordinary(off.keys[0])


def test_small_tensors_and_other_devices_keep_ordinary_memory():
    small = pool_memory.kv_zeros((3, 100, 64), torch.float32, "cpu", huge=True)
    assert small.shape == (3, 100, 64) and pool_memory.huge_advised(small) is False
    meta = pool_memory.kv_zeros((3, 1 << 16, 64), torch.float32, "meta", huge=True)
    assert meta.device.type == "meta"
    assert not pool_memory.wants_huge("cuda") and not pool_memory.wants_huge(torch.device("meta"))
    assert pool_memory.wants_huge("cpu") is weight_pages.HUGE_KV


def _grow_and_compact(pool: KVPool, seed: int) -> list[torch.Tensor]:
    """Writes, growth past several huge pages, then enough frees for a compaction; the K/V before and
    after each change, as copies."""
    g = torch.Generator().manual_seed(seed)
    seen = []
    ids = [pool.alloc(0, 300)]
    k = torch.randn(3, 300, 64, generator=g)
    pool.write(0, ids[0], k, 2 * k)
    for _ in range(6):  # grows to ~14k slots (10 MiB a tensor)
        new = pool.alloc(0, 2000)
        k = torch.randn(3, 2000, 64, generator=g)
        pool.write(0, new, k, -k)
        ids.append(new)
        seen.append(pool.keys[0].clone())
    before = pool.compactions
    pool.release(0, torch.cat(ids[1:5], 1))  # one release: compaction remaps ids the test holds
    assert pool.compactions > before  # the pool shrank (live entries moved down)
    seen += [pool.keys[0].clone(), pool.values[0].clone()]
    return seen


def test_growth_and_compaction_keep_contents_and_huge_pages():
    on = KVPool(_spec(torch.float32, 1), 0, grow=True, huge=True)
    off = KVPool(_spec(torch.float32, 1), 0, grow=True, huge=False)
    a, b = _grow_and_compact(on, 1), _grow_and_compact(off, 1)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert on.capacity(0) == off.capacity(0) >= _slots_for(torch.float32, HUGE)
    _assert_huge(on.keys[0])
    _assert_huge(on.values[0])
    _assert_ordinary(off.keys[0])


def test_a_grown_pool_keeps_what_it_held():
    pool = KVPool(_spec(torch.bfloat16, 1), 16, grow=True, huge=True)
    ids = pool.alloc(0, 16)
    k = torch.randn(3, 16, 64).to(torch.bfloat16)
    pool.write(0, ids, k, k + 1)
    pool.alloc(0, _slots_for(torch.bfloat16, 2 * HUGE))
    _assert_huge(pool.keys[0])
    assert torch.equal(pool.keys[0][:, :16], k) and torch.equal(pool.values[0][:, :16], k + 1)


def _decode(engine, images, policy_name: str, fixed: bool) -> tuple[list[torch.Tensor], list, KVPool]:
    """A prefill and four greedy decode steps of two prompts: every step's logits, each layer's K/V."""
    from vlkv.runtime.kv import PoolSpec as Spec

    batch = engine.encode([Prompt("Describe the picture.", [images[0]]), Prompt("Two?", [images[1]])])
    policy = make_policy(policy_name, **({} if policy_name == "full" else {"budget": 0.5}))
    pool = KVPool.with_bytes(Spec.for_backend(engine.backend), 1 << 22) if fixed else None
    cache = engine.new_cache(batch, pool)
    out = engine.prefill(batch, policy, cache)
    logits = [out.logits]
    tok = out.logits.argmax(-1)
    for step in range(1, 5):
        out = engine.decode(tok, batch, policy, cache, step)
        logits.append(out.logits)
        tok = out.logits.argmax(-1)
    kv = [t for layer in cache.layers for t in layer.attention_kv()]
    return logits, kv, cache.pool


@pytest.mark.parametrize("fixed", [False, True], ids=["growable", "fixed"])
@pytest.mark.parametrize("policy_name", ["full", "h2o", "snapkv"])
def test_decoding_is_bit_equal_with_the_pool_in_huge_pages(engines, images, monkeypatch, policy_name, fixed):
    engine = engines["tiny-llava"]
    monkeypatch.setattr(pool_memory, "MIN_BYTES", 0)  # the tiny model's pool takes the huge-page path too
    real, mapped = weight_pages.zeros, []

    def zeros(shape, dtype):  # the pool's own huge-page mappings, counted per run
        mapped.append(shape)
        return real(shape, dtype)

    monkeypatch.setattr(weight_pages, "zeros", zeros)
    runs, maps = {}, {}
    for on in (True, False):
        monkeypatch.setattr(weight_pages, "HUGE_KV", on)
        mapped.clear()
        runs[on] = _decode(engine, images, policy_name, fixed)
        maps[on] = len(mapped)
    (l_on, kv_on, pool_on), (l_off, kv_off, pool_off) = runs[True], runs[False]
    assert pool_on.huge and not pool_off.huge
    assert all(pool_memory.huge_advised(t) for t in pool_on.keys if t.numel())
    # off: no mapping of its own (the allocator's memory may sit where an earlier test advised huge pages,
    # so the mapping's flags cannot tell)
    assert maps[True] > 0 and maps[False] == 0
    assert len(l_on) == len(l_off) == 5
    for a, b in zip(l_on, l_off, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(kv_on, kv_off, strict=True):
        assert torch.equal(a, b)
