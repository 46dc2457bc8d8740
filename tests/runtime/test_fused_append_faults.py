"""A fused decode append (``vlkv.runtime.fused_append.fused_decode_row``) that fails leaves its layer as it was.

The host side of the append (tables grown, slots taken from the spares or the pool, lengths, sequence
indices) runs before the C++ call that writes the K/V rows and the tables' new column. Where that call
refuses (an argument it checks before writing, or a check inside its read after writing) or raises,
the reservation is taken back: the failing layer's tables, lengths, spares and the pool's free slots,
references and byte counts equal what they were, and the next step runs as if the failed one never
had. Through the scheduler, a batched step that fails so is undone and its requests rerun one by one:
only the request the fault follows fails, the others' tokens equal their solo runs, the pool ends empty.
"""

from __future__ import annotations

import pytest
import torch

import vlkv.plugins.paged_append as paged_append
from tests.runtime.test_fused_append import TEXTS, TOL, _full
from tests.runtime.test_holes import _holey
from tests.runtime.test_scheduler import sched_entry_bytes
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request, Status
from vlkv.runtime.scheduler import Scheduler


class Fault:
    """Makes the fused call of one pool layer fail while ``armed`` (and ``when(args)`` holds), as
    ``kind`` says: ``"dtype"`` int32 lengths (refused by the kernel before it writes anything),
    ``"width"`` a probabilities width of 1 (refused inside its read, after the K/V rows and the new
    column are written), ``"raise"`` the kernel runs, then the call raises."""

    def __init__(self, monkeypatch, pool_of, layer: int, kind: str, when=None):
        self.armed, self.hits, self.calls = True, 0, 0
        real = paged_append.append_attend

        def call(q, k_new, v_new, k_pool, *rest, probs_width=None):
            self.calls += 1
            pool = pool_of()
            hit = self.armed and pool is not None and k_pool is pool.keys[layer]
            if not hit or (when is not None and not when(rest)):
                return real(q, k_new, v_new, k_pool, *rest, probs_width=probs_width)
            self.hits += 1
            if kind == "dtype":
                *head, lengths, scale = rest
                return real(q, k_new, v_new, k_pool, *head, lengths.int(), scale, probs_width=probs_width)
            if kind == "width":
                return real(q, k_new, v_new, k_pool, *rest, probs_width=1)
            real(q, k_new, v_new, k_pool, *rest, probs_width=probs_width)
            raise RuntimeError("injected fused-append fault")

        if paged_append.kernel() is None:
            pytest.fail("the fused CPU decode append did not build (is a C++ compiler installed?)")
        monkeypatch.setattr(paged_append, "append_attend", call)


def _layer_state(la) -> dict:
    """What a failed append must not change in one layer's cache: lengths, the live columns of every
    table, the next sequence index, the spares, and the K/V / pre-RoPE flags at its held slots."""
    n = la.max_length
    held = la.held_mask()[:, :, :n]
    # each sample's valid columns (a shorter sample's next column, past its length, is free to change)
    valid = la.valid_mask(n)[:, None, :].expand(la.batch, la.kv_heads, n)
    heads = torch.arange(la.kv_heads)[None, :, None].expand_as(held)
    slots = la.slots[:, :, :n][held]
    pool = la.pool
    out = {
        "lengths": la.lengths.clone(),
        "host": list(la.host_lengths()),
        "next_order": la.next_order.clone(),
        "spares": la.spares.count(),
        "spare_ids": None if la.spare_ids is None else la.spare_ids.clone(),
        "recycled": None if la.recycled is None else la.recycled.clone(),
        "holes": None if la.holes is None else la.holes[:, :, :n][valid],
        "kv": [
            getattr(pool, s)[la.layer][heads[held], slots].clone() for s in ("keys", "values", "_prerope")
        ],
    }
    for t in ("slots", "positions", "modality", "order"):
        out[t] = getattr(la, t)[:, :, :n][valid]
    out.update({f"score:{k}": s[:, :, :n][valid] for k, s in la.scores.items()})
    return out


def _pool_state(pool, layers) -> dict:
    """The pool's allocated slots per head (a growable pool grown for the failed append has more free
    ones) and references in ``layers``."""
    return {
        "used_slots": [[pool.capacity(i) - f for f in pool._nfree_host[i]] for i in layers],
        "refs": [pool._refs[i].clone() for i in layers],
    }


def _assert_same(before, after, what: str) -> None:
    assert before.keys() == after.keys(), what
    for key, a in before.items():
        b = after[key]
        if key == "refs":  # a growable pool grown for the failed append keeps the room (all free)
            for x, y in zip(a, b):
                assert torch.equal(x, y[:, : x.shape[1]]) and not y[:, x.shape[1] :].any(), what
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"{what}: {key}"
        elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{what}: {key}"
        else:
            assert a == b, f"{what}: {key}"


@pytest.mark.parametrize("kind", ["dtype", "width", "raise"])
@pytest.mark.parametrize("prepare", [_full, _holey], ids=["full", "holes"])
@pytest.mark.parametrize("policy", [("full", {}), ("h2o", {"budget": 0.7})], ids=["no-stats", "h2o-stats"])
def test_a_failed_fused_call_leaves_a_batch_cache_as_it_was(
    kind, prepare, policy, engines, images, monkeypatch
):
    """``Engine.decode`` on a batch cache: the fault in layer 0's call propagates; every layer (and
    the pool) equals its state before the step; the step then reruns and the tokens and logits of
    every step equal the reference path's (``VLKV_CPU_APPEND=0``) from the same prefill."""
    engine = engines["tiny-llava"]
    prompts = [Prompt(TEXTS[0], [images[0]]), Prompt(TEXTS[2]), Prompt(TEXTS[1], [images[1]])]
    steps, bad = 4, 2

    def run(fused: bool, fault_at: int | None):
        monkeypatch.setattr(paged_append, "FUSED_APPEND", fused)
        batch, cache, out = prepare(engine, prompts)
        pol = make_policy(policy[0], **policy[1])
        fault = Fault(monkeypatch, lambda: cache.layers[0].pool, 0, kind)
        fault.armed = False
        tokens, outs = out.logits.argmax(-1), []
        for step in range(steps):
            if step == fault_at:
                layers = [la.layer for la in cache.layers]
                pool = cache.layers[0].pool
                before = [_layer_state(la) for la in cache.layers], _pool_state(pool, layers)
                counts = pool.used_bytes(), pool.bytes_written
                fault.armed = True
                with pytest.raises(RuntimeError):
                    engine.decode(tokens, batch, pol, cache, step + 1)
                fault.armed = False
                assert fault.hits == 1
                after = [_layer_state(la) for la in cache.layers], _pool_state(pool, layers)
                assert (pool.used_bytes(), pool.bytes_written) == counts
                for i, (a, b) in enumerate(zip(before[0], after[0])):
                    _assert_same(a, b, f"layer {i}")
                _assert_same(before[1], after[1], "pool")
            res = engine.decode(tokens, batch, pol, cache, step + 1)
            outs.append(res)
            tokens = res.logits.argmax(-1)
        return outs

    fused, ref = run(True, bad), run(False, None)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a.logits, b.logits, **TOL)
        assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))


@pytest.mark.parametrize("kind", ["dtype", "width", "raise"])
@pytest.mark.parametrize("fixed", [False, True], ids=["growable-run-spares", "fixed-pool"])
def test_a_failed_fused_call_leaves_batch_view_layers_as_they_were(kind, fixed, engines, images, monkeypatch):
    """A scheduler's batch view (one-sample caches; on a growable pool each continues its run of
    spare slots, on a fixed pool each takes fresh slots): the fault in a middle layer's call propagates
    out of the backend step; that layer and every later one, in every request, and the pool's layer
    equal their state before; layers below it appended their entry."""
    engine = engines["tiny-llava"]
    n_layers = engine.backend.num_layers
    mid = n_layers // 2
    sched = Scheduler(engine, sched_entry_bytes(engine) * 4000 if fixed else None)
    fault = Fault(monkeypatch, lambda: sched.pool, mid, kind)
    fault.armed = False
    reqs = [
        sched.submit(
            Request(Prompt(t, [images[0]] if i % 2 == 0 else []), make_policy("full"), 6, stop_at_eos=False)
        )
        for i, t in enumerate(TEXTS)
    ]
    while sched.waiting:  # the prefills, then one decode step
        sched.step()
    sched.step()
    plan = sched.plan()
    assert plan.is_decode and len(plan.groups) == 1
    group = plan.groups[0]
    caches = [r.cache for r in reqs]
    before = [[_layer_state(la) for la in c.layers] for c in caches], _pool_state(sched.pool, [mid])
    written = sched.pool.bytes_written
    fault.armed = True
    with pytest.raises(RuntimeError):
        engine.backend.step(group.inputs, group.batch, group.stats)
    fault.armed = False
    assert fault.hits == 1
    after = [[_layer_state(la) for la in c.layers] for c in caches], _pool_state(sched.pool, [mid])
    for b in range(len(caches)):
        for i in range(n_layers):
            if i < mid:  # appended: one entry longer
                assert after[0][b][i]["host"] == [before[0][b][i]["host"][0] + 1]
            else:
                _assert_same(before[0][b][i], after[0][b][i], f"request {b}, layer {i}")
    _assert_same(before[1], after[1], f"pool layer {mid}")
    # the pool's byte count: the layers below's new entries only
    assert sched.pool.bytes_written - written == mid * len(reqs) * sched.pool.spec.entry_bytes


def _solo(engine, prompt, max_new) -> list[int]:
    return engine.generate([prompt], make_policy("full"), max_new, stop_at_eos=False).samples[0].token_ids


@pytest.mark.parametrize("kind", ["dtype", "width", "raise"])
@pytest.mark.parametrize("fixed", [False, True], ids=["growable", "fixed-pool"])
def test_a_fault_that_follows_one_request_fails_it_alone(kind, fixed, engines, images, monkeypatch):
    """Through the scheduler (the user-facing path): the fused call of a middle layer fails whenever
    one request, whose positions no other reaches, is in the batch. The batched step is undone and
    rerun one request at a time: that request fails alone with the kernel's error, every other one
    finishes with its solo run's tokens, and the pool is empty afterwards."""
    engine = engines["tiny-llava"]
    max_new = 5
    long_text = " ".join(["the red square sits left of a blue circle"] * 12)
    prompts = [Prompt(t, [images[i % 2]] if i % 2 == 0 else []) for i, t in enumerate(TEXTS)]
    bad_prompt = Prompt(long_text, [images[0]])
    limit = max(engine.encode([p]).lengths.item() for p in prompts) + max_new + 8
    assert engine.encode([bad_prompt]).lengths.item() > limit
    sched = Scheduler(engine, sched_entry_bytes(engine) * 4000 if fixed else None)
    # columns.pos_new (B, P): the new entries' positions; only the long request's pass ``limit``
    fault = Fault(
        monkeypatch,
        lambda: sched.pool,
        engine.backend.num_layers // 2,
        kind,
        lambda rest: bool((rest[5].pos_new > limit).any()),
    )
    reqs = [sched.submit(Request(p, make_policy("full"), max_new, stop_at_eos=False)) for p in prompts[:2]]
    bad = sched.submit(Request(bad_prompt, make_policy("full"), max_new, stop_at_eos=False))
    reqs += [sched.submit(Request(p, make_policy("full"), max_new, stop_at_eos=False)) for p in prompts[2:]]
    sched.run()
    assert fault.hits >= 2  # the batched step, then the request alone
    assert sched.retried_steps >= 1
    assert bad.status is Status.FAILED and len(bad.tokens) == 1, bad.error
    assert "RuntimeError" in bad.error
    for r, p in zip(reqs, prompts):
        assert r.status is Status.FINISHED, r.error
        assert r.tokens == _solo(engine, p, max_new)
    assert sched.pool.used_bytes() == 0
    assert all(sched.pool.free_slots(i) == sched.pool.capacity(i) for i in range(engine.backend.num_layers))
