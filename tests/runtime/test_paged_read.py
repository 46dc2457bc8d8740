"""A plain decode step reads K/V from the pool through the slot tables (``ops.paged_attention``).

What must hold: no decode step gathers a scratch copy of any cache (``KVPool.read`` is not called);
each live entry's K/V is read once (the tables hand each held slot to the op once, and together they
cover every entry the requests hold); only the new entries are written; and the logits equal the
dense read's (the path before it) on ragged batches, on fixed and growable pools, with per-head holes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import vlkv.plugins.ops as ops
import vlkv.plugins.paged_cpu as paged_cpu
from tests.runtime.test_holes import _holey, _next_logits
from tests.runtime.test_scheduler import sched_entry_bytes
from vlkv.runtime.kv.pool import KVPool
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler
from vlkv.runtime.step_context import StepContext

TEXTS = ["Describe the picture.", "What is in the corner of this image?", "Hi.", "Tell me about the colors."]


@pytest.fixture(autouse=True)
def separate_read(monkeypatch):
    """These tests count the separate paged read (``ops.paged_attention`` and its CPU plan): the fused
    append-and-read, which replaces it where it can, is off here (tests/runtime/test_fused_append.py
    counts what it reads and checks it against this path)."""
    import vlkv.plugins.paged_append as paged_append

    monkeypatch.setattr(paged_append, "FUSED_APPEND", False)


@pytest.fixture
def counts(monkeypatch):
    """Bytes gathered by ``KVPool.read`` and by the CPU form's gathers; the tables of every paged call."""
    seen = SimpleNamespace(pool_read=0, cpu_gather=0, calls=[], rotated=0)
    real_read, real_paged, real_gather = KVPool.read, ops.paged_attention, paged_cpu._gather

    def read(self, layer, ids, scratch=False):
        seen.pool_read += 2 * ids.numel() * self.spec.head_dim * self.spec.dtype.itemsize
        return real_read(self, layer, ids, scratch)

    def paged(q, k_pool, v_pool, table, lengths, scale, **kw):
        seen.calls.append((k_pool.shape[0], table.clone(), lengths.clone(), k_pool.element_size()))
        seen.rotated += 0 if kw.get("rot") is None else int((kw["rot"] >= 0).sum())
        return real_paged(q, k_pool, v_pool, table, lengths, scale, **kw)

    def gather(pool, flat, out=None):
        seen.cpu_gather += flat.numel() * pool.shape[-1] * pool.element_size()
        return real_gather(pool, flat, out)

    monkeypatch.setattr(KVPool, "read", read)
    monkeypatch.setattr(ops, "paged_attention", paged)
    monkeypatch.setattr(paged_cpu, "_gather", gather)
    return seen


def _held_bytes(calls, head_dim: int) -> int:
    """K + V bytes the paged calls read: each held slot of each table once (asserted unique per head)."""
    total = 0
    for kv_heads, table, lengths, itemsize in calls:
        cols = torch.arange(table.shape[2])
        held = (cols < lengths[..., None]) & (table >= 0)
        for h in range(kv_heads):
            slots = table[:, h][held[:, h]]
            assert slots.unique().numel() == slots.numel()  # no slot read twice in one call
        total += int(held.sum()) * 2 * head_dim * itemsize // 1
    return total


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-pool", "growable-pool"])
def test_a_decode_step_reads_each_live_entry_once_and_copies_no_cache(
    fixed, engines, images, counts, monkeypatch
):
    # tiny prompts are ~50 entries: a request and a run that short count as long here, as a prompt's
    # run does at scale (shorter requests are gathered together, tested in tests/plugins)
    monkeypatch.setattr(paged_cpu, "RUN_MIN", 16)
    monkeypatch.setattr(paged_cpu, "INPLACE_MIN", 16)
    engine = engines["tiny-llava"]
    per_token = sched_entry_bytes(engine)
    sched = Scheduler(engine, per_token * 4000 if fixed else None)
    reqs = [
        sched.submit(Request(Prompt(t, [images[0]] if i % 2 == 0 else []), make_policy("full"), 8, stop_at_eos=False))
        for i, t in enumerate(TEXTS)
    ]  # fmt: skip
    sched.step()  # prefill every request, first decode step
    head_dim = engine.backend.head_dim
    for _ in range(4):
        counts.pool_read, counts.cpu_gather, counts.calls = 0, 0, []
        written = sched.pool.bytes_written
        sched.step()
        live = [r for r in sched.running if r.cache is not None]
        assert len(live) == len(reqs) and len(counts.calls) == engine.backend.num_layers
        assert counts.pool_read == 0  # no padded scratch copy of the caches
        assert sched.pool.bytes_written - written == len(live) * per_token  # only the new entries
        # each entry every request holds (the new one included) read once, by the paged op
        assert _held_bytes(counts.calls, head_dim) == sum(r.cache.kv_bytes() for r in live)
        if not fixed:  # each request's entries one run of slots: read in place, nothing gathered
            assert counts.cpu_gather == 0
        else:  # the prompt's run in place; only the decode appends (interleaved in the pool) gathered
            assert counts.cpu_gather < sum(r.cache.kv_bytes() for r in live) // 4
    sched.run()
    assert all(r.error is None and len(r.tokens) == 8 for r in reqs)


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_paged_tokens_equal_the_dense_read(name, engines, images, monkeypatch, counts):
    engine = engines[name]
    prompts = [Prompt(t, [images[i % 2]] if i < 2 else []) for i, t in enumerate(TEXTS)]
    got = engine.generate(prompts, make_policy("full"), 8, stop_at_eos=False)
    assert counts.calls  # the decode steps read paged
    monkeypatch.setattr(StepContext, "reads_paged", lambda self, layer, i: False)
    want = engine.generate(prompts, make_policy("full"), 8, stop_at_eos=False)
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]


def test_paged_read_skips_each_heads_holes(engines, images, monkeypatch, counts):
    engine = engines["tiny-llava"]
    prompts = [Prompt("The cat sat on the mat by the fire.", [images[0]]), Prompt("Short one.")]
    batch, cache, out = _holey(engine, prompts, seed=5)
    tokens = out.logits.argmax(-1)
    counts.pool_read, counts.calls = 0, []  # the prefill's reads are not the decode step's
    got = _next_logits(engine, batch, cache, tokens)
    assert counts.calls and any(bool((t < 0).any()) for _, t, _, _ in counts.calls)  # holes reached the op
    assert counts.pool_read == 0
    monkeypatch.setattr(StepContext, "reads_paged", lambda self, layer, i: False)
    batch, cache, out = _holey(engine, prompts, seed=5)
    torch.testing.assert_close(got, _next_logits(engine, batch, cache, tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])  # 1-D RoPE and M-RoPE
def test_linked_pre_rope_entries_are_rotated_by_the_paged_read(name, engines, images, monkeypatch, counts):
    from tests.runtime.link.test_linker import _decode, _linked, _pool
    from vlkv.runtime.link.segment_store import SegmentStore
    from vlkv.runtime.link.spec import LinkSpec

    engine = engines[name]
    first = Prompt("Compare these.", [images[0], images[1]])
    again = Prompt("You are terse. Compare these two.", [images[1], images[0]])
    store = SegmentStore(_pool(engine))
    _linked(engine, first, LinkSpec("mpic", 2), store)
    batch, cache, out, stats = _linked(engine, again, LinkSpec("mpic", 2), store)
    assert stats.hits == 2 and any(layer.linked for layer in cache.layers)
    counts.calls, counts.rotated = [], 0
    token = out.logits.argmax(-1)
    logits = engine.decode(token, batch, make_policy("full"), cache, 1).logits
    assert counts.calls and counts.rotated > 0  # a linked decode step reads paged, rotating on read
    got = _decode(engine, batch, cache, out, 4)[1:]  # more steps, the same on both sides
    monkeypatch.setattr(StepContext, "reads_paged", lambda self, layer, i: False)
    batch, cache, out, _ = _linked(engine, again, LinkSpec("mpic", 2), store)
    want = engine.decode(token, batch, make_policy("full"), cache, 1).logits
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert _decode(engine, batch, cache, out, 4)[1:] == got


@pytest.mark.parametrize("kernel_on", [False, True], ids=["halves", "fused-kernel"])
@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_statistics_steps_read_paged_and_equal_the_dense_read(
    budget, kernel_on, engines, images, monkeypatch, counts
):
    """A per-step policy (H2O: statistics every decode step, eviction from them) reads through the
    tables (the two halves of ``paged_probs``, or with the fused CPU kernel its one read of each head's
    table row): its tokens and kept bytes equal the dense read's."""
    import vlkv.plugins.paged_probs as paged_probs

    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", kernel_on)
    seen = []
    name = "fused_decode_probs" if kernel_on else "paged_decode_probs"
    real = getattr(paged_probs, name)

    def called(*a, **kw):
        got = real(*a, **kw)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(paged_probs, name, called)
    engine = engines["tiny-llava"]
    prompts = [Prompt(t, [images[i % 2]] if i < 2 else []) for i, t in enumerate(TEXTS)]
    got = engine.generate(prompts, make_policy("h2o", budget=budget), 8, stop_at_eos=False)
    assert seen and all(seen)  # the statistics came from the paged probabilities (the kernel's, when on)
    monkeypatch.setattr(StepContext, "reads_paged", lambda self, layer, i: False)
    want = engine.generate(prompts, make_policy("h2o", budget=budget), 8, stop_at_eos=False)
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]
    assert got.kv_bytes_used == want.kv_bytes_used


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-pool", "growable-pool"])
def test_a_decode_step_plans_its_cpu_read_once_per_table(fixed, engines, images, monkeypatch):
    """The CPU read's plan (runs, gathered rows, masks) is built once per step when every layer holds
    the same tables, and once more for each layer whose tables differ; the tokens are the dense read's."""
    monkeypatch.setattr(paged_cpu, "RUN_MIN", 16)
    monkeypatch.setattr(paged_cpu, "INPLACE_MIN", 16)
    engine = engines["tiny-llava"]
    built, tables = [], []
    real_plan, real_paged = paged_cpu.plan_for, ops.paged_attention
    monkeypatch.setattr(paged_cpu, "plan_for", lambda *a, **kw: built.append(1) or real_plan(*a, **kw))

    def paged(q, k_pool, v_pool, table, lengths, scale, **kw):
        tables.append((table.clone(), lengths.clone()))
        return real_paged(q, k_pool, v_pool, table, lengths, scale, **kw)

    monkeypatch.setattr(ops, "paged_attention", paged)
    sched = Scheduler(engine, sched_entry_bytes(engine) * 4000 if fixed else None)
    reqs = [
        sched.submit(Request(Prompt(t, [images[0]] if i % 2 == 0 else []), make_policy("full"), 6, stop_at_eos=False))
        for i, t in enumerate(TEXTS)
    ]  # fmt: skip
    sched.step()
    for _ in range(3):
        built.clear(), tables.clear()
        sched.step()
        distinct = 1 + sum(
            not (torch.equal(t, p) and torch.equal(n, m)) for (t, n), (p, m) in zip(tables[1:], tables[:-1])
        )
        assert len(tables) == engine.backend.num_layers and len(built) == distinct
        assert distinct == 1  # a full cache: every layer holds the same tables, one plan per step
    sched.run()
    got = [list(r.tokens) for r in reqs]
    monkeypatch.setattr(StepContext, "reads_paged", lambda self, layer, i: False)
    want = engine.generate([r.prompt for r in reqs], make_policy("full"), 6, stop_at_eos=False)
    assert got == [s.token_ids for s in want.samples]


@pytest.mark.parametrize(
    "policy",
    [("kvzip", {"budget": 0.5}), ("snapkv", {"budget": 0.3, "window": 4}), ("kvgrad", {"budget": 0.25})],
    ids=["kvzip-holes", "snapkv-per-head", "kvgrad-holes"],
)
def test_a_per_head_decode_step_reads_only_the_live_entries(policy, engines, images, monkeypatch, counts):
    """Per-head caches (each KV head its own entries: per-head slot rows, KVzip's holes) decode through
    the fused CPU kernel's table rows: each head's live entries read once, in place — no scratch copy
    of any cache, nothing gathered — and the tokens equal the dense read's."""
    import vlkv.plugins.paged_cpu_kernel as kernel
    import vlkv.runtime.kv.packing as packing
    from vlkv.plugins.paged_reference import held_columns

    assert kernel.kernel() is not None, (
        "the fused CPU decode kernel did not build (is a C++ compiler installed?)"
    )
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", True)
    # snapkv's per-head rows stay per-head slot rows (packed, every head would read one shared run)
    monkeypatch.setattr(packing, "PACK", False)
    read = [0]
    real_rows = kernel.table_attention

    def rows(qs, k_pool, v_pool, table, lengths):
        read[0] += int(held_columns(table, lengths).sum()) * 2 * k_pool.shape[-1] * k_pool.element_size()
        return real_rows(qs, k_pool, v_pool, table, lengths)

    monkeypatch.setattr(kernel, "table_attention", rows)
    engine = engines["tiny-llava"]
    name, kw = policy
    sched = Scheduler(engine, sched_entry_bytes(engine) * 4000)
    reqs = [
        sched.submit(Request(Prompt(t, [images[0]] if i % 2 == 0 else []), make_policy(name, **kw), 6, stop_at_eos=False))
        for i, t in enumerate(TEXTS)
    ]  # fmt: skip
    sched.step()  # prefill (and the policy's compression), first decode step
    per_head = False
    for _ in range(3):
        counts.pool_read, counts.cpu_gather, read[0] = 0, 0, 0
        sched.step()
        live = [r for r in sched.running if r.cache is not None]
        assert len(live) == len(reqs)
        per_head |= any(
            not bool((layer.slots[:, :1] == layer.slots).all()) or layer.holes is not None
            for r in live
            for layer in r.cache.layers
        )
        assert counts.pool_read == 0 and counts.cpu_gather == 0  # no scratch copy, nothing gathered
        assert read[0] == sum(r.cache.kv_bytes() for r in live)  # each live entry once, no padding
        # the tables' width: a head with holes reads fewer (KVzip's per-head budgets), never more
        width = sum(sum(layer.host_lengths()) for r in live for layer in r.cache.layers)
        holes = any(layer.holes is not None for r in live for layer in r.cache.layers)
        assert (
            (read[0] < width * sched.pool.spec.entry_bytes)
            if holes
            else (read[0] == width * sched.pool.spec.entry_bytes)
        )
    assert per_head  # the policy really left per-head tables
    sched.run()
    got = [list(r.tokens) for r in reqs]
    monkeypatch.setattr(StepContext, "reads_paged", lambda self, layer, i: False)
    want = engine.generate([r.prompt for r in reqs], make_policy(name, **kw), 6, stop_at_eos=False)
    assert got == [s.token_ids for s in want.samples]


@pytest.mark.parametrize(
    "policy",
    [("h2o", {"budget": 0.5}), ("h2o", {"budget": 0.3}), ("avl", {"budget": 0.5})],
    ids=["h2o-0.5", "h2o-0.3", "avl-0.5"],
)
def test_a_statistics_decode_step_gathers_no_kv(policy, engines, images, monkeypatch, counts):
    """A decode step that wants statistics (H2O's scores every step, A-VL's text scores on its update
    steps) reads each held entry's K/V once, through the fused CPU kernel's table rows, for its output
    and its probabilities together: no scratch copy of any cache, nothing gathered (bytes counted),
    not by the CPU read nor by ``paged_probs``' halves; the tokens equal the dense read's."""
    import vlkv.plugins.paged_cpu_kernel as kernel
    import vlkv.plugins.paged_probs as paged_probs
    from vlkv.plugins.paged_reference import held_columns

    assert kernel.kernel() is not None, (
        "the fused CPU decode kernel did not build (is a C++ compiler installed?)"
    )
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", True)
    read, halves = [0, 0], [0]
    real_probs, real_gathered = kernel.table_attention_probs, paged_probs._gathered

    def probs(qs, k_pool, v_pool, table, lengths):
        read[0] += int(held_columns(table, lengths).sum()) * 2 * k_pool.shape[-1] * k_pool.element_size()
        read[1] += 1
        return real_probs(qs, k_pool, v_pool, table, lengths)

    def gathered(pool, table, held, idx):
        got = real_gathered(pool, table, held, idx)
        halves[0] += got.numel() * got.element_size()
        return got

    monkeypatch.setattr(kernel, "table_attention_probs", probs)
    monkeypatch.setattr(paged_probs, "_gathered", gathered)
    engine = engines["tiny-llava"]
    name, kw = policy
    sched = Scheduler(engine, sched_entry_bytes(engine) * 4000)
    reqs = [
        sched.submit(Request(Prompt(t, [images[0]] if i % 2 == 0 else []), make_policy(name, **kw), 6, stop_at_eos=False))
        for i, t in enumerate(TEXTS)
    ]  # fmt: skip
    sched.step()  # prefill (and the policy's compression), first decode step
    stats_steps = 0
    per_token = sched_entry_bytes(engine)
    for _ in range(3):
        counts.pool_read, counts.cpu_gather, halves[0], read[0], read[1] = 0, 0, 0, 0, 0
        held = sum(r.cache.kv_bytes() for r in sched.running if r.cache is not None)
        sched.step()
        live = [r for r in sched.running if r.cache is not None]
        assert len(live) == len(reqs)
        assert counts.pool_read == 0 and counts.cpu_gather == 0 and halves[0] == 0  # nothing gathered
        if read[1]:  # a statistics step: every layer read once, each live entry once, no padding
            stats_steps += 1
            assert read[1] == engine.backend.num_layers
            # what the caches held before the step and its new entries (the policy evicts after it)
            assert read[0] == held + len(live) * per_token
    assert stats_steps  # the policy's statistics steps went through the kernel
    sched.run()
    got = [list(r.tokens) for r in reqs]
    monkeypatch.setattr(StepContext, "reads_paged", lambda self, layer, i: False)
    want = engine.generate([r.prompt for r in reqs], make_policy(name, **kw), 6, stop_at_eos=False)
    assert got == [s.token_ids for s in want.samples]


@pytest.mark.parametrize("model", ["tiny-llava", "tiny-qwen2-vl"])
@pytest.mark.parametrize(
    "policy",
    [("h2o", {"budget": 0.4}), ("avl", {"budget": 0.5}), ("elastic", {"budget": 0.5})],
    ids=["h2o", "avl", "elastic"],
)
def test_per_step_policies_decode_the_same_tokens_with_the_kernel_on_and_off(
    policy, model, engines, images, monkeypatch
):
    """H2O, A-VL and Elastic Cache generate the same tokens and keep the same bytes with the fused CPU
    kernel's statistics read (on) and without it (``VLKV_CPU_KERNEL=0``: the two halves)."""
    name, kw = policy
    engine = engines[model]
    prompts = [Prompt(t, [images[i % 2]] if i < 2 else []) for i, t in enumerate(TEXTS)]
    runs = []
    for on in (True, False):
        monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", on)
        runs.append(engine.generate(prompts, make_policy(name, **kw), 8, stop_at_eos=False))
    got, want = runs
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]
    assert got.kv_bytes_used == want.kv_bytes_used
