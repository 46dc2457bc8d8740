"""A fixed pool's byte budget covers low-rank factors: the layer holds ceil(factor bytes / entry
bytes) slots beside its dense ones, given back as factors shrink, densify, swap out or finish; the
scheduler's admission and accounting see them."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_image
from tests.runtime.test_scheduler import sched_entry_bytes
from vlkv.runtime.kv.lowrank import densify
from vlkv.runtime.kv.pool import KVPool, PoolSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler

PROMPTS = [Prompt("What is in the picture?", [make_image(7, 96)]), Prompt("Just text here.", [])]


def _dense_slots(layer) -> int:
    return int(layer.held_mask().sum()) // layer.kv_heads


def _charged(layer) -> int:
    nbytes = 0 if layer.lowrank is None else layer.lowrank.nbytes()
    return -(-nbytes // layer.pool.spec.entry_bytes)


@pytest.mark.parametrize("path", ["a", "b"])
def test_fixed_pool_holds_slots_for_the_factor_bytes(engines, path):
    engine = engines["tiny-llava"]
    batch = engine.encode(PROMPTS)
    pool = KVPool.with_bytes(PoolSpec.for_backend(engine.backend), sched_entry_bytes(engine) * 400)
    cache = engine.new_cache(batch, pool=pool)
    engine.prefill(batch, make_policy("attnpack", rank=3, path=path), cache)
    for i, layer in enumerate(cache.layers):
        assert layer.lowrank is not None and _charged(layer) > 0
        assert layer.ballast.shape == (layer.kv_heads, _charged(layer))
        assert pool.used_slots(i) == _dense_slots(layer) + _charged(layer)
        # bytes the pool gives the layer cover what the cache reports holding, within one slot
        held = pool.used_slots(i) * pool.spec.entry_bytes
        reported = cache.kv_bytes() // len(cache.layers)
        assert (
            0
            <= held - layer.lowrank.nbytes() - _dense_slots(layer) * pool.spec.entry_bytes
            < pool.spec.entry_bytes
        )
        assert held >= reported - pool.spec.entry_bytes
    layer = cache.layers[0]
    densify(layer)  # factors gone: their slots pay for the dense entries instead
    assert layer.ballast is None and pool.used_slots(0) == _dense_slots(layer)
    cache.release()
    assert all(pool.used_slots(i) == 0 for i in range(len(cache.layers)))


def test_growable_pool_charges_nothing(engines):
    engine = engines["tiny-llava"]
    batch = engine.encode(PROMPTS[:1])
    cache = engine.new_cache(batch)
    engine.prefill(batch, make_policy("attnpack", rank=3), cache)
    assert all(layer.ballast is None for layer in cache.layers)


@pytest.mark.parametrize("path", ["a", "b"])
def test_offload_gives_the_factor_slots_back_and_reload_restores_the_factors(engines, path):
    # a preempted attnpack request resumes with exactly the cache it had: its factors swap with its
    # dense K/V (a reload that rebuilt them dense changed later tokens, and held more slots)
    engine = engines["tiny-llava"]
    batch = engine.encode(PROMPTS[:1])
    pool = KVPool.with_bytes(PoolSpec.for_backend(engine.backend), sched_entry_bytes(engine) * 400)
    cache = engine.new_cache(batch, pool=pool)
    engine.prefill(batch, make_policy("attnpack", rank=3, path=path), cache)
    layer = cache.layers[1]
    k_before, v_before = layer.attention_kv(layer.max_length)
    slots_before, charged = layer.slots.clone(), _charged(layer)
    layer.offload()
    assert layer.ballast is None and pool.used_slots(1) == 0
    assert layer.offloaded_factors.samples[0].kbar.device.type == "cpu"
    layer.reload()
    assert layer.lowrank is not None and layer.lowrank.post_rope == (path == "b")
    assert torch.equal(layer.slots < 0, slots_before < 0)  # the same columns are factors
    k_after, v_after = layer.attention_kv(layer.max_length)
    assert _charged(layer) == charged and pool.used_slots(1) == _dense_slots(layer) + charged
    torch.testing.assert_close(k_after, k_before, rtol=0, atol=0)
    torch.testing.assert_close(v_after, v_before, rtol=0, atol=0)


def test_scheduler_accounting_counts_factor_slots(engines):
    """With attnpack requests on a fixed pool, the pool's used bytes equal what the requests hold
    (dense + factors, each layer's factors rounded up to whole slots) at every step."""
    engine = engines["tiny-llava"]
    sched = Scheduler(engine, sched_entry_bytes(engine) * 600)
    reqs = [
        sched.submit(Request(p, make_policy("attnpack", rank=3), 6, stop_at_eos=False)) for p in PROMPTS * 2
    ]
    for _ in range(4):
        sched.step()
        live = [r.cache for r in sched.running if r.cache is not None]
        assert live
        charged = sum(_charged(layer) for c in live for layer in c.layers) * sched.pool.spec.entry_bytes
        dense = sum(_dense_slots(layer) for c in live for layer in c.layers) * sched.pool.spec.entry_bytes
        assert sched.pool.used_bytes() == dense + charged
        assert charged > 0
    sched.run()
    assert all(r.done for r in reqs)
    assert sched.pool.used_bytes() == 0
