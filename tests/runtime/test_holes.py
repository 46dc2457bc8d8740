"""Per-head holes: a column evicted from some KV heads only (per-head budgets).

What must hold: a hole frees its pool slot and is counted nowhere; attention and statistics of every
path (one-row decode, multi-row steps, the scheduler's batch view) skip it for its head only; holes
survive edits, appends, offload/reload and pool compaction with identical logits.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlkv.runtime.attention_rows import _stats
from vlkv.runtime.cache import LayerKV, Modality
from vlkv.runtime.kv import pool as pool_mod
from vlkv.runtime.kv.batch import CacheBatch
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.step_context import StepContext

TEXT = "The cat sat on the mat while the dog slept by the warm fire all night long."


def _reference_attention(q, k, v, scale, past, new_len, open_):
    """Per query head and row: softmax over keys ``j <= past + i``, ``j < past + new_len``, ``open_``."""
    b, h, nq, _ = q.shape
    g = h // k.shape[1]
    out = torch.zeros_like(q)
    colsum = torch.zeros(b, h, k.shape[2])
    for s in range(b):
        for hq in range(h):
            for i in range(int(new_len[s])):
                j = torch.arange(k.shape[2])
                vis = (j <= past[s] + i) & (j < past[s] + new_len[s]) & open_[s, hq // g]
                w = torch.softmax(
                    (k[s, hq // g] @ q[s, hq, i]) * scale + torch.where(vis, 0.0, -torch.inf), 0
                )
                out[s, hq, i] = w @ v[s, hq // g]
                colsum[s, hq] += w
    return out, colsum


@pytest.mark.parametrize("nq", [1, 3])
def test_attention_and_stats_skip_each_heads_holes(nq):
    torch.manual_seed(0)
    b, hkv, g, s, d = 2, 2, 2, 11, 8
    q = torch.randn(b, hkv * g, nq, d)
    k, v = torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    past = torch.tensor([7, 5])
    new_len = torch.tensor([nq, max(nq - 1, 1)])
    open_ = torch.rand(b, hkv, s) > 0.35
    open_[:, :, 0] = True  # every row sees at least one key
    ctx = SimpleNamespace(plain=False)
    got = StepContext._attend_full(ctx, q, k, v, 0.3, past, new_len, open_)
    want, colsum = _reference_attention(q, k, v, 0.3, past, new_len, open_)
    rows = torch.arange(nq)[None, :] < new_len[:, None]
    for s_ in range(b):
        n = int(new_len[s_])
        torch.testing.assert_close(got[s_, :, :n], want[s_, :, :n], atol=1e-5, rtol=1e-5)
    st = _stats(q, k, 0.3, rows, None, past, new_len, None, open_)
    torch.testing.assert_close(st.colsum.float(), colsum, atol=1e-5, rtol=1e-5)
    holes = ~open_.repeat_interleave(g, dim=1)
    assert bool((st.colsum[holes] == 0).all())  # a hole gets no attention from its head's rows


def _layer(pool_width=12):
    torch.manual_seed(1)
    layer = LayerKV.empty(2, 2, 4, 1, torch.float32, "cpu")
    n = pool_width
    k, v = torch.randn(2, 2, n, 4), torch.randn(2, 2, n, 4)
    pos = torch.arange(n)[None, :, None].expand(2, n, 1)
    layer.append(k, v, pos, torch.zeros(2, n, dtype=torch.int8), torch.tensor([n, n - 3]))
    return layer, k, v


def test_holes_free_their_slots_and_are_not_counted():
    layer, k, v = _layer()
    per_head_entry = layer.pool.spec.entry_bytes // 2
    index = torch.tensor([0, 2, 3, 5, 8])[None, None].expand(2, 2, 5).clone()
    holes = torch.zeros(2, 2, 5, dtype=torch.bool)
    holes[0, 0, [1, 3]] = True  # sample 0 head 0 keeps 3 entries, head 1 keeps 5
    holes[1, 1, 4] = True  # sample 1 head 1 keeps 4
    before = layer.pool.used_bytes()
    layer.select(index, torch.tensor([5, 5]), holes=holes)
    held = 3 + 5 + 5 + 4
    assert layer.kv_bytes() == held * per_head_entry
    assert layer.pool.used_bytes() == held * per_head_entry < before
    assert not bool(layer.open_mask(5)[0, 0, 1]) and bool(layer.open_mask(5)[0, 1, 1])
    # the survivors keep their K/V; appends are held by every head
    kk, _ = layer.attention_kv()
    torch.testing.assert_close(kk[0, 1], k[0, 1, [0, 2, 3, 5, 8]])
    layer.append(
        torch.randn(2, 2, 1, 4),
        torch.randn(2, 2, 1, 4),
        torch.full((2, 1, 1), 20),
        torch.zeros(2, 1),
        torch.ones(2, dtype=torch.long),
    )
    assert layer.kv_bytes() == (held + 4) * per_head_entry
    assert bool(layer.open_mask(6)[:, :, 5].all())
    # a second eviction keeps the holes that survive it; merging a holey cache is refused
    layer.select(torch.tensor([1, 3, 5])[None, None].expand(2, 2, 3).clone(), torch.tensor([3, 3]))
    assert layer.open_mask(3)[0, 0].tolist() == [False, False, True]
    with pytest.raises(ValueError, match="holes"):
        layer.merge(
            torch.tensor([0])[None, None].expand(2, 2, 1).clone(),
            torch.tensor([1, 1]),
            torch.zeros(2, 2, 3, dtype=torch.long),
            torch.full((2, 2, 1), 3),
        )
    layer.release()
    assert layer.pool.used_bytes() == 0


def _holey(engine, prompts, seed=0, ids=None, same=False, pool=None):
    """A prefilled cache with random per-head holes in every layer (sinks and the last entry kept).

    The pattern of sample ``b`` depends on ``(seed, layer, ids[b])`` only, so a single-request cache
    of prompt ``ids[b]`` gets the same holes as that row of a batch.
    """
    ids = list(range(len(prompts))) if ids is None else ids
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch, pool=pool)
    out = engine.prefill(batch, make_policy("full"), cache)
    for li, layer in enumerate(cache.layers):
        n = layer.max_length
        index = torch.arange(n)[None, None].expand(layer.batch, layer.kv_heads, n).clone()
        holes = torch.zeros(layer.batch, layer.kv_heads, n, dtype=torch.bool)
        for b, pid in enumerate(ids):
            gen = torch.Generator().manual_seed(seed * 1000 + li * 10 + pid)
            m = int(layer.lengths[b])
            holes[b, :, :m] = torch.rand(1 if same else layer.kv_heads, m, generator=gen) < 0.4
            holes[b, :, :2] = False
            holes[b, :, m - 1] = False
        layer.select(index, layer.lengths.clone(), holes=holes)
    return batch, cache, out


def _next_logits(engine, batch, cache, tokens):
    return engine.decode(tokens, batch, make_policy("full"), cache, step=1).logits


def test_same_holes_in_every_head_equal_eviction(engines, images):
    """Holes at the same columns in every KV head are just evicted columns: same logits, bytes and
    statistics (the hole columns get none)."""
    engine = engines["tiny-llava"]
    prompts = [Prompt(TEXT, [images[0]]), Prompt("Short one.")]
    batch, holey, out = _holey(engine, prompts, same=True)
    evicted = engine.new_cache(batch)
    engine.prefill(batch, make_policy("full"), evicted)
    kept = []
    for a, b in zip(holey.layers, evicted.layers):
        valid = a.valid_mask()[:, : a.max_length]
        common = a.open_mask(a.max_length)[:, 0] & valid  # (B, S)
        order = torch.sort((~common).to(torch.int8), dim=1, stable=True).indices
        b.select(order[:, None, :].expand(b.batch, b.kv_heads, -1).clone(), common.sum(1))
        kept.append((common, order, valid))
    assert holey.kv_bytes() == evicted.kv_bytes() < holey.full_kv_bytes()
    tokens = out.logits.argmax(-1)
    policy = make_policy("h2o", budget=0.99)  # asks for every row's statistics, evicts nothing yet
    got = engine.backend.step(*_decode_inputs(engine, batch, policy, holey, tokens))
    want = engine.backend.step(*_decode_inputs(engine, batch, policy, evicted, tokens))
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    for (common, order, valid), sa, sb in zip(kept, got.stats, want.stats):
        for s_ in range(common.shape[0]):
            n = int(common[s_].sum())
            cols = order[s_, :n]
            torch.testing.assert_close(sa.colsum[s_][:, cols], sb.colsum[s_][:, :n], atol=1e-5, rtol=1e-5)
            width = common.shape[1]
            assert bool((sa.colsum[s_][:, :width][:, valid[s_] & ~common[s_]] == 0).all())


def _decode_inputs(engine, batch, policy, cache, tokens):
    from vlkv.runtime.backend import StepInputs

    ctx = engine.context(batch, 1)
    b = tokens.shape[0]
    inputs = StepInputs(
        tokens[:, None],
        engine.decode_positions(policy, cache),
        torch.full((b, 1), int(Modality.GENERATED), dtype=torch.int8),
        torch.ones(b, dtype=torch.long),
    )
    return inputs, cache, policy.decode_request(cache, ctx)


def test_holes_survive_the_batch_view_offload_and_compaction(engines, images, monkeypatch):
    engine = engines["tiny-llava"]
    prompts = [Prompt(TEXT, [images[0]]), Prompt("Short one.")]
    batch, cache, out = _holey(engine, prompts, seed=3)
    tokens = out.logits.argmax(-1)
    want = _next_logits(engine, batch, cache, tokens)
    assert any(bool((~layer.open_mask(layer.max_length)).any()) for layer in cache.layers)

    # one request per single-sample cache, read through the scheduler's batch view
    first = _holey(engine, [prompts[0]], seed=3, ids=[0])[1]
    singles = [first, _holey(engine, [prompts[1]], seed=3, ids=[1], pool=first.pool)[1]]
    view = CacheBatch(singles)
    from vlkv.runtime.backend import StepInputs

    inputs = StepInputs(
        tokens[:, None],
        torch.stack([c.next_position for c in singles])[:, 0][:, None],
        torch.full((2, 1), int(Modality.GENERATED), dtype=torch.int8),
        torch.ones(2, dtype=torch.long),
    )
    got = engine.backend.step(inputs, view, None).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # offload + reload gives the same next logits, and holes still hold no slot
    _, moved, _ = _holey(engine, prompts, seed=3)
    used = moved.pool.used_bytes()
    moved.offload("cpu")
    moved.reload()
    assert moved.pool.used_bytes() == used == moved.kv_bytes()
    torch.testing.assert_close(_next_logits(engine, batch, moved, tokens), want, atol=1e-5, rtol=1e-5)

    # compaction moves survivors and remaps tables; holes follow (no stale slot ids)
    monkeypatch.setattr(pool_mod, "COMPACT_MIN_SLOTS", 8)
    _, packed, _ = _holey(engine, prompts, seed=3)
    compactions = packed.pool.compactions
    for layer in packed.layers:
        n = layer.max_length
        keep = torch.arange(n)[None, None].expand(layer.batch, layer.kv_heads, n).clone()
        layer.select(keep, layer.lengths.clone())  # no-op edit: holes stay
        packed.pool.compact(layer.layer)
    assert packed.pool.compactions > compactions
    torch.testing.assert_close(_next_logits(engine, batch, packed, tokens), want, atol=1e-5, rtol=1e-5)
