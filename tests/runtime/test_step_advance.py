"""A fused decode step computes every layer's new lengths and next sequence indices once, for all layers.

Each layer's fused append (``fused_append.fused_decode_row``) used to compute its own: per layer an
op for the lengths and one for the next indices (per request and layer on a scheduler's one-sample
caches, plus the kernel's lengths before and after). ``kv.reservation.advance_all`` computes them for
every layer at the step's first fused layer in a few ops; each layer's reservation takes its views
where the layer is as it was then (else computes its own). What must hold: the same logits (bit for
bit), tables, lengths, next indices and pool as with each layer computing its own, on a batch cache
(``Engine.decode``) and a scheduler's batch views, and fewer ops per step by about two per layer and
request; ``advance_all``'s values equal the per-layer computation on ragged lengths.
"""

from __future__ import annotations

import pytest
import torch

import scripts.count_step_ops as count_step_ops
import vlkv.plugins.paged_append as paged_append
import vlkv.runtime.fused_append as fused_append
from tests.runtime.test_fused_append import TEXTS, _full
from vlkv.runtime.cache import LayerKV, private_pool
from vlkv.runtime.kv.reservation import advance_all, next_order
from vlkv.runtime.op_count import count_ops
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler


@pytest.fixture(autouse=True)
def built():
    if paged_append.kernel() is None:
        pytest.fail("the fused CPU decode append did not build (is a C++ compiler installed?)")


def _state(layers) -> list:
    out = []
    for la in layers:
        n = la.max_length
        tables = [getattr(la, t)[:, :, :n].clone() for t in ("slots", "positions", "modality", "order")]
        out.append((la.lengths.clone(), la.host_lengths(), tables, la.next_order.clone()))
    pool = layers[0].pool
    out.append((pool.used_bytes(), pool.bytes_written))
    return out


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _own(monkeypatch) -> None:
    """Each layer computes its own lengths and next indices (the code before)."""
    monkeypatch.setattr(fused_append, "_ahead", lambda *a: None)


@pytest.mark.parametrize("policy", [("full", {}), ("h2o", {"budget": 0.5})], ids=["full", "h2o"])
def test_a_batch_cache_step_is_the_same_in_fewer_ops(policy, engines, images, monkeypatch):
    engine = engines["tiny-llava"]
    layers = engine.backend.num_layers
    prompts = [Prompt(TEXTS[0], [images[0]]), Prompt(TEXTS[2]), Prompt(TEXTS[1], [images[1]])]  # ragged
    got = {}
    for ahead in (True, False):
        if not ahead:
            _own(monkeypatch)
        batch, cache, out = _full(engine, prompts)
        pol = make_policy(policy[0], **policy[1])
        tokens, logits, ops = out.logits.argmax(-1), [], []
        for step in range(4):
            with count_ops() as c:
                res = engine.decode(tokens, batch, pol, cache, step + 1)
            ops.append(c.ops)
            logits.append(res.logits)
            tokens = res.logits.argmax(-1)
        got[ahead] = (logits, _state(cache.layers), ops)
    _same(got[True][:2], got[False][:2])
    for on, off in zip(got[True][2], got[False][2]):  # per layer a maximum and an add, for ~9 ops once
        assert off - on >= 2 * layers - 10, (on, off)


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_a_scheduler_step_is_the_same_in_fewer_ops(policy, monkeypatch):
    """A scheduler decode step of 4 requests on an 8-layer tiny LLaVA (``scripts/count_step_ops``)."""
    engine = count_step_ops.tiny_engine(8)
    layers, batch = 8, 4
    got = {}
    for ahead in (True, False):
        if not ahead:
            _own(monkeypatch)
        c = count_step_ops.count_decode_step(engine, policy, batch)
        sched = Scheduler(engine)
        texts = ["Describe the scene in detail.", "Hi", "What colour is the sky today?", "Count them."]
        reqs = [
            sched.submit(
                Request(
                    Prompt(t), make_policy(policy, **count_step_ops.POLICIES[policy]), 6, stop_at_eos=False
                )
            )
            for t in texts
        ]
        sched.run()
        got[ahead] = (c.ops, [r.tokens for r in reqs])
    assert got[True][1] == got[False][1]
    # per layer: per request a maximum and an add, the lengths before and after: for ~10 ops once
    assert got[False][0] - got[True][0] >= layers * (2 * batch + 2) - 12, got


def test_advance_all_equals_each_layer_s_own():
    """Ragged lengths, next indices behind and ahead of the step's: the views equal ``past + 1`` and
    ``max(next_order, order_next)`` per layer and owner, each owner its own element."""
    pool = private_pool(3, 2, 8, torch.float32, "cpu")
    layers = []
    for li, lens in enumerate(([5, 3], [4, 4], [6, 1])):
        la = LayerKV(pool, li, 2, 1)
        n = max(lens)
        la.append(
            torch.zeros(2, 2, n, 8),
            torch.zeros(2, 2, n, 8),
            torch.zeros(2, n, 1, dtype=torch.long),
            torch.zeros(2, n, dtype=torch.int8),
            torch.tensor(lens),
        )
        la.next_order = torch.tensor([7, 2]) + li
        layers.append(la)
    order_next = torch.tensor([8, 4])
    got = advance_all([[la] for la in layers], order_next)
    for la, adv in zip(layers, got):
        assert adv.host == la.host_lengths() and adv.holds_for([la], la.host_lengths())
        assert torch.equal(adv.past, la.lengths) and torch.equal(adv.after, la.lengths + 1)
        assert torch.equal(adv.lengths[0], la.lengths + 1)
        assert torch.equal(adv.orders[0], next_order(la.next_order, order_next))
    got[0].orders[0].add_(100)  # one owner's view: no other owner's value moves
    assert torch.equal(got[1].orders[0], next_order(layers[1].next_order, order_next))
    layers[2].next_order = layers[2].next_order + 1  # changed since: the layer computes its own
    assert not got[2].holds_for([layers[2]], layers[2].host_lengths())
