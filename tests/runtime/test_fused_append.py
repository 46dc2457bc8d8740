"""A decode layer's append and paged read as one C++ call (``vlkv.runtime.fused_append.fused_decode_row``) against the
reference path (``ctx.update``'s Python append, then the registered attention function's paged read).

What must hold: the fused path is taken on every decode layer it can serve (counted), and with it on
or off the caches hold the same K/V bytes at the same slots, the same tables and lengths, the logits
agree within fp32 rounding and greedy tokens are equal: batch caches (``Engine.decode``) and a
scheduler's batch views (``Engine.generate``), tiny LLaVA (1-D RoPE) and tiny Qwen2-VL (M-RoPE), a full
cache, per-head tables and holes (KVzip's per-head budgets), a statistics policy (H2O: the fused call
also returns the probabilities it wants), ragged lengths. ``VLKV_CPU_APPEND=0`` turns it off; without a
compiler it is never taken.
"""

from __future__ import annotations

import pytest
import torch

import vlkv.plugins.paged_append as paged_append
from tests.conftest import switch_values
from tests.runtime.test_holes import _holey
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

# the fused read sums in the order of the kernel the separate read also runs for these tables: equal
# up to fp32 rounding (a request read in place by runs merges its segments in another order)
TOL = {"rtol": 1e-5, "atol": 1e-5}
TEXTS = ["Describe the picture.", "What is in the corner of this image?", "Hi.", "Tell me about the colors."]


@pytest.fixture
def taken(monkeypatch):
    """Calls of the fused kernel (one per decode layer that took the path)."""
    calls = [0]
    real = paged_append.append_attend

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    if paged_append.kernel() is None:
        pytest.fail("the fused CPU decode append did not build (is a C++ compiler installed?)")
    monkeypatch.setattr(paged_append, "append_attend", counted)
    return calls


def _decode_both(engine, prompts, steps, prepare, monkeypatch, taken, policy=("full", {})):
    """``steps`` greedy decode steps of the same prefilled batch cache with the fused path on and off:
    per side the outputs of each step, the cache and the fused calls."""
    got = {}
    for on in (True, False):
        monkeypatch.setattr(paged_append, "FUSED_APPEND", on)
        batch, cache, out = prepare(engine, prompts)
        tokens, outs = out.logits.argmax(-1), []
        before = taken[0]
        pol = make_policy(policy[0], **policy[1])
        for step in range(steps):
            res = engine.decode(tokens, batch, pol, cache, step + 1)
            outs.append(res)
            tokens = res.logits.argmax(-1)
        got[on] = (outs, cache, taken[0] - before)
    return got


def _full(engine, prompts):
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch)
    return batch, cache, engine.prefill(batch, make_policy("full"), cache)


def _snapkv_packed(engine, prompts):
    """A SnapKV prefill at budget 0.5 (per-head kept sets, packed into one run per row)."""
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch)
    return batch, cache, engine.prefill(batch, make_policy("snapkv", budget=0.5), cache)


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
@pytest.mark.parametrize("prepare", [_full, _snapkv_packed], ids=["full", "snapkv-packed"])
def test_long_rows_read_as_a_run_then_appends_equal_the_reference(
    name, prepare, engines, images, monkeypatch, taken
):
    """Rows longer than the kernel's leading-run threshold (``PREFIX_MIN``), whole or packed after a
    SnapKV prefill: the fused read takes the run as contiguous rows and the appends through their
    slots, merged by their log-sum-exps; logits and tokens equal the reference path's."""
    engine = engines[name]
    long_text = " ".join(["the red square sits left of a blue circle"] * 80)
    prompts = [Prompt(long_text, [images[0]]), Prompt(long_text + " Why?")]
    got = _decode_both(engine, prompts, 4, prepare, monkeypatch, taken)
    (fused, cache_f, calls_f), (ref, _, calls_r) = got[True], got[False]
    assert calls_f == 4 * engine.backend.num_layers and calls_r == 0
    assert min(cache_f.layers[0].host_lengths()) > 256
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a.logits, b.logits, **TOL)
        assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
@pytest.mark.parametrize("prepare", [_full, _holey], ids=["full", "holes"])
@pytest.mark.parametrize("policy", [("full", {}), ("h2o", {"budget": 0.7})], ids=["no-stats", "h2o-stats"])
def test_batch_cache_steps_equal_the_reference(name, prepare, policy, engines, images, monkeypatch, taken):
    """Steps of a batch cache (``Engine.decode``), ragged, with and without per-head holes; H2O's steps
    want every layer's statistics (and evict from them): those equal the reference's too."""
    engine = engines[name]
    prompts = [Prompt(TEXTS[0], [images[0]]), Prompt(TEXTS[2]), Prompt(TEXTS[1], [images[1]])]  # ragged
    steps = 4
    got = _decode_both(engine, prompts, steps, prepare, monkeypatch, taken, policy)
    (fused, cache_f, calls_f), (ref, cache_r, calls_r) = got[True], got[False]
    assert calls_f == steps * engine.backend.num_layers and calls_r == 0
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a.logits, b.logits, **TOL)
        assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
        torch.testing.assert_close(a.attended, b.attended, rtol=0, atol=0)
        assert (a.stats is None) == (b.stats is None)
        for sa, sb in zip(a.stats or [], b.stats or []):
            assert (sa is None) == (sb is None)
            if sa is not None:
                torch.testing.assert_close(sa.colsum, sb.colsum, **TOL)
                assert torch.equal(sa.visible, sb.visible)
                assert (sa.below is None) == (sb.below is None)
                if sa.below is not None:
                    assert torch.equal(sa.below, sb.below)
    for la, lb in zip(cache_f.layers, cache_r.layers):
        assert torch.equal(la.lengths, lb.lengths) and la.host_lengths() == lb.host_lengths()
        n = la.max_length
        for t in ("slots", "positions", "modality", "order"):
            assert torch.equal(getattr(la, t)[:, :, :n], getattr(lb, t)[:, :, :n]), t
        assert torch.equal(la.next_order, lb.next_order)
        assert (la.holes is None) == (lb.holes is None)
        # the pool bytes: every held slot's K and V equal (the new rows written by the kernel), and the
        # pre-RoPE flags
        held = la.held_mask()
        heads = torch.arange(la.kv_heads)[None, :, None].expand_as(la.slots)
        slots, heads = la.slots[held], heads[held]
        for store in ("keys", "values", "_prerope"):
            pa, pb = getattr(la.pool, store)[la.layer], getattr(lb.pool, store)[lb.layer]
            assert torch.equal(pa[heads, slots], pb[heads, slots]), store
        assert la.pool.bytes_written == lb.pool.bytes_written


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
@pytest.mark.parametrize(
    "policy",
    [
        ("full", {}),
        ("snapkv", {"budget": 0.3, "window": 4}),
        ("kvzip", {"budget": 0.5}),
        ("h2o", {"budget": 0.5}),
    ],
    ids=["full", "snapkv-per-head", "kvzip-holes", "h2o-stats"],
)
def test_scheduler_generation_gives_the_same_tokens(name, policy, engines, images, monkeypatch, taken):
    """``Engine.generate`` (a scheduler's one-sample caches seen through a batch view): greedy tokens
    with the fused path equal the reference path's, for every policy's decode path."""
    engine = engines[name]
    kind, kw = policy
    prompts = [Prompt(t, [images[i % 2]] if i % 2 == 0 else []) for i, t in enumerate(TEXTS)]
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(paged_append, "FUSED_APPEND", on)
        before = taken[0]
        res = engine.generate(prompts, make_policy(kind, **kw), 6, stop_at_eos=False)
        runs[on] = ([s.token_ids for s in res.samples], taken[0] - before)
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == 0 and runs[True][1] > 0


def test_the_environment_switches_it():
    got = switch_values("vlkv.plugins.paged_append", "FUSED_APPEND", "VLKV_CPU_APPEND", [None, "0", "1"])
    assert got == {None: "True", "0": "False", "1": "True"}


def test_without_a_compiler_the_reference_path_runs(engines, images, monkeypatch, taken):
    import vlkv.plugins.paged_cpu_kernel as paged_cpu_kernel

    # as where the build failed (it warned once): no fused read, no fused append (one extension)
    monkeypatch.setattr(paged_cpu_kernel, "_BUILT", [None])
    assert paged_append.kernel() is None
    engine = engines["tiny-llava"]
    prompts = [Prompt(TEXTS[0], [images[0]]), Prompt(TEXTS[2])]
    res = engine.generate(prompts, make_policy("full"), 4, stop_at_eos=False)
    assert taken[0] == 0
    monkeypatch.setattr(paged_cpu_kernel, "_BUILT", [])
    assert [s.token_ids for s in res.samples] == [
        s.token_ids for s in engine.generate(prompts, make_policy("full"), 4, stop_at_eos=False).samples
    ]


@pytest.mark.parametrize("policy", [("full", {}), ("kvzip", {"budget": 0.5})], ids=["full", "kvzip-holes"])
def test_a_fused_step_reads_each_live_entry_once_and_writes_only_the_new_ones(
    policy, engines, images, monkeypatch, taken
):
    """A decode step through the fused path: no scratch copy of any cache (``KVPool.read``, the CPU
    read's gathers), no separate pool write; the entries the kernel reports read are each request's
    live entries (KVzip's holes skipped: fewer than its table's columns); the bytes written are the new
    entries'."""
    import vlkv.plugins.paged_cpu as paged_cpu
    from tests.runtime.test_scheduler import sched_entry_bytes
    from vlkv.runtime.kv.pool import KVPool
    from vlkv.runtime.request import Request
    from vlkv.runtime.scheduler import Scheduler

    counted = {"read": 0, "gather": 0, "write": 0}
    real_read, real_write, real_gather = KVPool.read, KVPool.write, paged_cpu._gather
    monkeypatch.setattr(
        KVPool, "read", lambda *a, **k: (counted.__setitem__("read", 1), real_read(*a, **k))[1]
    )
    monkeypatch.setattr(
        KVPool, "write", lambda *a, **k: (counted.__setitem__("write", 1), real_write(*a, **k))[1]
    )
    monkeypatch.setattr(
        paged_cpu, "_gather", lambda *a, **k: (counted.__setitem__("gather", 1), real_gather(*a, **k))[1]
    )
    attended = []
    real = paged_append.append_attend
    monkeypatch.setattr(
        paged_append,
        "append_attend",
        lambda *a, **k: (lambda r: (attended.append(r[1]), r)[1])(real(*a, **k)),
    )
    engine = engines["tiny-llava"]
    name, kw = policy
    sched = Scheduler(engine, sched_entry_bytes(engine) * 4000)
    for i, t in enumerate(TEXTS):
        sched.submit(
            Request(
                Prompt(t, [images[0]] if i % 2 == 0 else []), make_policy(name, **kw), 6, stop_at_eos=False
            )
        )
    sched.step()  # prefill (and the policy's compression), first decode step
    for _ in range(2):
        for key in counted:
            counted[key] = 0
        attended.clear()
        written = sched.pool.bytes_written
        sched.step()
        live = [r for r in sched.running if r.cache is not None]
        assert len(attended) == engine.backend.num_layers and not any(counted.values())
        entry = sched.pool.spec.entry_bytes
        # live entries read, mean over KV heads per request: summed, the bytes the caches hold
        assert round(float(sum(a.sum() for a in attended)) * entry) == sum(r.cache.kv_bytes() for r in live)
        assert sched.pool.bytes_written - written == len(live) * engine.backend.num_layers * entry


def test_the_fused_read_s_switch_turns_it_off_too(engines, images, monkeypatch, taken):
    """``VLKV_CPU_KERNEL=0`` (the fused read off): the append in front of it is off as well."""
    import vlkv.plugins.paged_cpu as paged_cpu

    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", False)
    engines["tiny-llava"].generate([Prompt(TEXTS[2])], make_policy("full"), 3, stop_at_eos=False)
    assert taken[0] == 0
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", True)
    engines["tiny-llava"].generate([Prompt(TEXTS[2])], make_policy("full"), 3, stop_at_eos=False)
    assert taken[0] > 0


def test_only_score_tables_the_call_can_zero_are_handed_to_it():
    """The C++ append zeroes a cache's running scores only where they are float32, shaped like the slot
    table and unit-stride per column; any other table (the reservation zeroes it then) would make the
    call refuse, failing the step."""
    from vlkv.runtime.fused_append import _score_fits

    slots = torch.zeros(2, 3, 8, dtype=torch.long)
    assert _score_fits(torch.zeros(2, 3, 8), slots)
    assert not _score_fits(torch.zeros(2, 3, 8, dtype=torch.float64), slots)
    assert not _score_fits(torch.zeros(2, 3, 9), slots)
    assert not _score_fits(torch.zeros(2, 3, 16)[:, :, ::2], slots)
