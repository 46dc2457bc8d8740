"""Packing (``kv.packing``): a prompt's eviction moves each row's kept K/V into one run of slots and
changes nothing else — the same tables (slot ids aside), the same K/V per column, the same slots free
afterwards — and leaves alone what it must not move (shared slots, holes, a decode step's few drops).
"""

from __future__ import annotations

import pytest
import torch

import vlkv.runtime.kv.packing as packing
from tests.runtime.policies.kept_sets import MODELS, SPECS, _held, kept_digests, spec_id
from vlkv.runtime.cache import LayerKV
from vlkv.runtime.kv.packing import row_runs
from vlkv.runtime.kv.pool import KVPool, PoolSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

H, D, P = 2, 8, 3


def _layer(lengths: tuple[int, ...], seed: int = 0, pool: KVPool | None = None) -> LayerKV:
    """A batch layer holding a prefill of ``lengths`` (one append: one run per sample), a score."""
    g = torch.Generator().manual_seed(seed)
    b, q = len(lengths), max(lengths)
    layer = LayerKV.empty(b, H, D, P, torch.float32, "cpu") if pool is None else LayerKV(pool, 0, b, P)
    layer.append(
        torch.randn(b, H, q, D, generator=g),
        torch.randn(b, H, q, D, generator=g),
        torch.randint(0, 50, (b, q, P), generator=g),
        torch.randint(0, 3, (b, q), generator=g).to(torch.int8),
        torch.tensor(lengths),
    )
    layer.scores["s"] = torch.rand(b, H, layer.capacity, generator=g)
    return layer


def _per_head_keep(lengths: tuple[int, ...], keep: list[int], seed: int) -> torch.Tensor:
    """``(B, H, max(keep))`` ascending columns, a different random subset per sample and head."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n, k in zip(lengths, keep):
        heads = [torch.randperm(n, generator=g)[:k].sort().values for _ in range(H)]
        pad = max(keep) - k
        rows.append(torch.stack([torch.cat([c, c.new_zeros(pad)]) for c in heads]))
    return torch.stack(rows)


def _select(layer: LayerKV, index, keep, pack: bool, **kw) -> None:
    was, packing.PACK = packing.PACK, pack
    try:
        layer.select(index, torch.tensor(keep), **kw)
    finally:
        packing.PACK = was


def _same_entries(a: LayerKV, b: LayerKV) -> None:
    """Equal lengths, tables (slots aside), scores and K/V over each sample's valid columns."""
    assert a.host_lengths() == b.host_lengths()
    n = a.max_length
    valid = a.valid_mask(n)[:, None, :].expand(a.batch, H, n)
    for name in ("order", "modality"):
        assert torch.equal(getattr(a, name)[:, :, :n][valid], getattr(b, name)[:, :, :n][valid]), name
    assert torch.equal(a.positions[:, :, :n][valid], b.positions[:, :, :n][valid])
    assert torch.equal(a.scores["s"][:, :, :n][valid], b.scores["s"][:, :, :n][valid])
    for x, y in zip(a.attention_kv(n), b.attention_kv(n)):
        assert torch.equal(x[valid], y[valid])


@pytest.mark.parametrize(
    ("lengths", "keep"),
    [((9, 9, 9), [4, 4, 4]), ((81, 81, 81), [9, 9, 9]), ((729,), [81]), ((12, 7, 9), [5, 7, 2])],
)
def test_a_prompt_eviction_packs_each_row_into_one_run(lengths, keep):
    """Per-head random kept sets (uniform and ragged batches): packed, every row is one run and every
    head the same run, sample after sample from slot 0; the entries, their K/V and the pool's free
    slots equal the unpacked select's; the moves are counted as bytes moved, not written."""
    packed, plain = _layer(lengths), _layer(lengths)
    index = _per_head_keep(lengths, keep, sum(lengths))
    written = packed.pool.bytes_written
    _select(packed, index, keep, True)
    _select(plain, index, keep, False)
    _same_entries(packed, plain)
    assert packed.pool.free_slots(0) == plain.pool.free_slots(0)
    assert packed.pool.used_bytes() == plain.pool.used_bytes() == packed.kv_bytes()
    assert packed.pool.bytes_written == written and packed.pool.bytes_moved > plain.pool.bytes_moved
    assert row_runs(packed).tolist() == [[1] * H for _ in lengths]
    start = 0
    for b, k in enumerate(keep):
        want = torch.arange(start, start + k).expand(H, k)
        assert torch.equal(packed.slots[b, :, :k], want), b
        start += k
    assert row_runs(plain).max() > 1, "the unpacked rows were scattered: the test would compare nothing"


def test_packed_rows_stay_runs_through_a_pool_compaction_and_take_appends():
    """A growable pool compacts after a large eviction (most slots free): the packed rows move as
    whole runs; the next appends land after them and read back what was written."""
    lengths, keep = (400, 400, 400), [40, 40, 40]
    packed, plain = _layer(lengths, 1), _layer(lengths, 1)
    index = _per_head_keep(lengths, keep, 5)
    _select(packed, index, keep, True)
    _select(plain, index, keep, False)
    assert packed.pool.compactions == plain.pool.compactions == 1
    _same_entries(packed, plain)
    assert row_runs(packed).tolist() == [[1] * H] * 3
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        k, v = torch.randn(3, H, 1, D, generator=g), torch.randn(3, H, 1, D, generator=g)
        pos, mod = torch.zeros(3, 1, P, dtype=torch.long), torch.zeros(3, 1, dtype=torch.int8)
        for layer in (packed, plain):
            layer.append(k, v, pos, mod, torch.ones(3, dtype=torch.long))
    _same_entries(packed, plain)


def _one_request(n: int, reserve: int, seed: int) -> LayerKV:
    """A one-sample cache on a growable pool holding an ``n``-entry prompt and ``reserve`` spare slots as
    one run (a scheduler request's ``run_reserve``), a score."""
    layer = LayerKV.empty(1, H, D, P, torch.float32, "cpu")
    layer.run_reserve = reserve
    g = torch.Generator().manual_seed(seed)
    layer.append(
        torch.randn(1, H, n, D, generator=g),
        torch.randn(1, H, n, D, generator=g),
        torch.randint(0, 50, (1, n, P), generator=g),
        torch.zeros(1, n, dtype=torch.int8),
        torch.tensor([n]),
    )
    layer.scores["s"] = torch.rand(1, H, layer.capacity, generator=g)
    return layer


def test_a_request_with_run_spares_stays_one_run_through_its_appends():
    """A one-sample cache on a growable pool holding its prompt and spare slots as one run (a
    scheduler request's ``run_reserve``): packed, the spares move right after the packed run, the
    decode appends continue it (one run), the pool holds what the unpacked cache holds, and the
    entries equal the unpacked cache's."""
    n, keep, reserve = 9, 4, 3
    packed, plain = _one_request(n, reserve, 8), _one_request(n, reserve, 8)
    assert packed.spares.next_id == n  # the spares continue the prompt's run
    index = _per_head_keep((n,), [keep], 9)
    _select(packed, index, [keep], True)
    _select(plain, index, [keep], False)
    assert packed.spares.next_id == keep and packed.spare_ids.tolist() == [[4, 5, 6]] * H
    assert packed.pool.used_slots(0) == plain.pool.used_slots(0) == keep + reserve
    g = torch.Generator().manual_seed(10)
    for _ in range(reserve):
        k, v = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
        pos, mod = torch.zeros(1, 1, P, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int8)
        for layer in (packed, plain):
            layer.append(k, v, pos, mod, torch.ones(1, dtype=torch.long))
    assert row_runs(packed).tolist() == [[1] * H] and row_runs(plain).max() > 1
    n2 = packed.max_length
    for x, y in zip(packed.attention_kv(n2), plain.attention_kv(n2)):
        assert torch.equal(x, y)


def test_a_compaction_after_packing_keeps_the_spares_run():
    """A one-sample cache keeps 100 of 2,000 entries: the release compacts the growable pool, and the
    spares, still one run right after the packed row, keep their first id — the decode appends stay
    on the one-id-per-step path and the row stays one run."""
    n, keep, reserve = 2000, 100, 8
    packed, plain = _one_request(n, reserve, 11), _one_request(n, reserve, 11)
    index = _per_head_keep((n,), [keep], 12)
    _select(packed, index, [keep], True)
    _select(plain, index, [keep], False)
    assert packed.pool.compactions == plain.pool.compactions == 1
    assert packed.spare_ids.tolist() == [list(range(keep, keep + reserve))] * H
    assert packed.spares.next_id == keep
    g = torch.Generator().manual_seed(13)
    for _ in range(reserve):
        k, v = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
        pos, mod = torch.zeros(1, 1, P, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int8)
        for layer in (packed, plain):
            layer.append(k, v, pos, mod, torch.ones(1, dtype=torch.long))
    assert row_runs(packed).tolist() == [[1] * H]
    _same_entries(packed, plain)


def test_a_layer_holding_pre_rope_slots_is_not_packed():
    """The pool's per-slot pre-RoPE flags do not move with the K/V: a layer holding a flagged slot is
    left as the unpacked select leaves it."""
    lengths, keep = (81, 81), [9, 9]
    flagged, plain = _layer(lengths, 3), _layer(lengths, 3)
    slot = flagged.slots[0, :, :1]  # (H_kv, 1): the first entry's slot in every head
    k, v = flagged.pool.keys[0][:, :1].clone(), flagged.pool.values[0][:, :1].clone()
    flagged.pool.write(0, slot, k, v, prerope=True)
    index = _per_head_keep(lengths, keep, 4)
    _select(flagged, index, keep, True)
    _select(plain, index, keep, False)
    assert torch.equal(flagged.slots, plain.slots)
    assert row_runs(flagged).max() > 1


def test_shared_slots_holes_and_a_decode_steps_few_drops_are_not_packed():
    """A slot another holder references (a linked or stored record), a cache with per-head holes and
    a decode-time eviction of a few entries per row keep their slots where they are."""
    lengths, keep = (9, 9), [4, 4]
    index = _per_head_keep(lengths, keep, 3)
    spec = PoolSpec(num_layers=1, kv_heads=H, head_dim=D, dtype=torch.float32, device="cpu")
    shared, plain = _layer(lengths, 4, KVPool(spec, 64, grow=False)), _layer(lengths, 4)
    shared.pool.retain(0, torch.tensor([1]), shared.slots[1, 1, 3:4])  # one slot has a second holder
    _select(shared, index, keep, True)
    _select(plain, index, keep, False)
    assert torch.equal(shared.slots[:, :, :4], plain.slots[:, :, :4])

    holed, plain = _layer(lengths, 5), _layer(lengths, 5)
    punch = torch.zeros(2, H, 4, dtype=torch.bool)
    punch[0, 1, 2] = True
    _select(holed, index, keep, True, holes=punch)
    _select(plain, index, keep, False, holes=punch)
    assert torch.equal(holed.slots[:, :, :4], plain.slots[:, :, :4])

    step, plain = _layer(lengths, 6), _layer(lengths, 6)
    few = _per_head_keep(lengths, [7, 7], 7)  # two of nine per row: a decode step's few
    _select(step, few, [7, 7], True, recycle=True)
    _select(plain, few, [7, 7], False, recycle=True)
    assert torch.equal(step.slots[:, :, :7], plain.slots[:, :, :7])


def _batch(engine, policy, prompts, steps: int):
    """Tokens, per-step kept sets and, after the prefill's edits, the runs per table row."""
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch)
    with torch.no_grad():
        out = engine.prefill(batch, policy, cache)
        runs = [row_runs(layer).tolist() for layer in cache.layers]
        tok, tokens, states = out.logits.argmax(-1), [], []
        for step in range(1, steps + 1):
            tok = engine.decode(tok, batch, policy, cache, step).logits.argmax(-1)
            tokens.append(tok.tolist())
            states.append([_held(layer) for layer in cache.layers])
    cache.release()
    return tokens, states, runs


# small windows: the scores pick a different subset per head on the tiny prompts
PROMPT_SPECS = [
    ("snapkv", {"budget": 0.5, "window": 4}),
    ("pyramidkv", {"budget": 0.5, "window": 4}),
    ("vlcache", {"budget": 0.5}),
    ("h2o", {"budget": 0.5}),
]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name,kw", PROMPT_SPECS, ids=[spec_id(n, kw) for n, kw in PROMPT_SPECS])
def test_a_batch_cache_packed_keeps_the_same_entries_and_tokens(
    model, name, kw, engines, images, monkeypatch
):
    """Three rows in step, different images, 6 decode steps: packed, every row of every layer is one
    run after the prefill's eviction; the kept sets of every step and the tokens equal the unpacked
    run's."""
    engine = engines[model]
    prompts = [Prompt("Describe the picture.", [im]) for im in images]
    assert len({int(n) for n in engine.encode(prompts).lengths}) == 1  # rows in step
    got = _batch(engine, make_policy(name, **kw), prompts, 6)
    monkeypatch.setattr(packing, "PACK", False)
    want = _batch(engine, make_policy(name, **kw), prompts, 6)
    assert all(r == 1 for layer in got[2] for row in layer for r in row), "a packed row is not one run"
    assert any(r > 1 for layer in want[2] for row in layer for r in row), "nothing was scattered"
    assert got[0] == want[0]
    for step, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
        assert g == w, f"step {step}: other entries kept"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name,kw", SPECS, ids=[spec_id(n, kw) for n, kw in SPECS])
def test_every_policy_keeps_the_same_sets_packed(model, name, kw, engines, images, monkeypatch):
    """Every policy setting of the kept-set suite, scheduler requests (one-sample caches): the kept
    sets at every decode step and the tokens equal the unpacked run's."""
    got = kept_digests(engines[model], name, kw, images)
    monkeypatch.setattr(packing, "PACK", False)
    want = kept_digests(engines[model], name, kw, images)
    assert got == want
