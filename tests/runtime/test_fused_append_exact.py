"""A statistics step through the fused decode append keeps ``StatsRequest.exact_output``.

``exact_output`` (H2O and A-VL at budget 1) asks for the step's attention output to be the backend's
plain attention, bit for bit what the same step without statistics computes, so that a policy which
evicts nothing equals the full cache. On fp32 CPU pools both steps take the fused append-and-read
(``fused_append.fused_decode_row`` → ``paged_append.append_attend``): the statistics step only asks the
same C++ read to also write the probabilities. What must hold, bit for bit (``torch.equal``):

- the kernel: its output and attended counts with ``probs_width`` equal those without, on the shapes a
  decode step gives it — a long leading run then scattered appends (the split read, merged by
  log-sum-exps), per-head holes, several caches, GQA groups 1 / 3 / 7 and head sizes 64 / 128 / 48;
- the runtime: H2O at budget 1 and the full cache give equal logits at every decode step (tiny LLaVA,
  tiny Qwen2-VL, rows longer than the split read's floor), every layer through the fused call.

(Not claimed: equality with the separate read ``paged_cpu`` runs with the fused append off; it merges a
request's run and appends in another order, equal within fp32 rounding — ``test_fused_append.py``.)
"""

from __future__ import annotations

import pytest
import torch

import vlkv.plugins.paged_append as paged_append
from tests.plugins.test_paged_append import _call, _case
from tests.runtime.test_fused_append import _full
from vlkv.plugins.paged_append import NewColumns
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt


def _split_case(group: int, dim: int, holes: bool, seed: int = 5):
    """Two requests whose rows are a long leading run (a prompt, past the kernel's ``PREFIX_MIN``) and
    then scattered slots (decode appends interleaved with the other request's), one with a hole per
    head among them when ``holes``; a third short request in a second cache (one pass through its
    slots)."""
    g = torch.Generator().manual_seed(seed)
    kv_heads, slots, cap = 2, 3000, 800
    k_pool = torch.randn(kv_heads, slots, dim, generator=g)
    v_pool = torch.randn(kv_heads, slots, dim, generator=g)
    runs, past = (300, 700, 40), torch.tensor([330, 709, 45])
    tail = torch.randperm(slots - 2200, generator=g) + 2200
    tables = [
        torch.zeros(2, kv_heads, cap, dtype=torch.long),
        torch.zeros(1, kv_heads, cap, dtype=torch.long),
    ]
    hole_tables = [torch.zeros_like(t, dtype=torch.bool) for t in tables]
    for b, (t, i) in enumerate([(0, 0), (0, 1), (1, 0)]):
        n = int(past[b]) - runs[b]
        tables[t][i, :, : runs[b]] = torch.arange(b * 720, b * 720 + runs[b])
        tables[t][i, :, runs[b] : past[b]] = tail[b * 50 : b * 50 + n]
        if holes:
            hole_tables[t][i, b % kv_heads, runs[b] + 2] = True
            hole_tables[t][i, 1 - b % kv_heads, 7] = True  # and one inside the leading run
    if not holes:
        hole_tables = [torch.empty(0, dtype=torch.bool)] * 2
    ids = tail[600:606].view(kv_heads, 3)
    columns = NewColumns(
        [torch.zeros(*t.shape, 1, dtype=torch.long) for t in tables],
        [torch.zeros(t.shape, dtype=torch.int8) for t in tables],
        [torch.zeros(t.shape, dtype=torch.long) for t in tables],
        past,
        past[:, None] + 3,
        torch.full((3,), 1, dtype=torch.int8),
        past + 3,
    )
    q = torch.randn(3, kv_heads, group, dim, generator=g)
    k_new = torch.randn(3, kv_heads, 1, dim, generator=g)
    v_new = torch.randn(3, kv_heads, 1, dim, generator=g)
    return (q, k_new, v_new, k_pool, v_pool, ids, tables, hole_tables, columns, past + 1)


def _fresh(case):
    """A copy of ``case`` whose pools and tables a call may write (the kernel appends in place)."""
    q, k_new, v_new, k_pool, v_pool, ids, tables, holes, c, lengths = case
    clone = lambda ts: [t.clone() for t in ts]  # noqa: E731
    cols = NewColumns(
        clone(c.positions), clone(c.modality), clone(c.order), c.cols, c.pos_new, c.mod_new, c.ord_new
    )
    return (q, k_new, v_new, k_pool.clone(), v_pool.clone(), ids, clone(tables), clone(holes), cols, lengths)


@pytest.fixture(autouse=True)
def built():
    if paged_append.kernel() is None:
        pytest.fail("the fused CPU decode append did not build (is a C++ compiler installed?)")


@pytest.mark.parametrize("holes", [False, True], ids=["dense", "holes"])
@pytest.mark.parametrize("dim,group", [(64, 3), (128, 1), (48, 7)])
@pytest.mark.parametrize("shape", ["split", "scattered"])
def test_the_output_with_probabilities_is_the_output_without(shape, dim, group, holes):
    """The same call with and without ``probs_width``: output and attended bit for bit (the
    probabilities are written beside the read, never folded back into it); pools and tables equal."""
    if shape == "split":
        case = _split_case(group, dim, holes)
    else:  # per-head tables of random slots (a KVzip-like cache): one pass through each row's slots
        case = _case(caches=(2, 1), kv_heads=2, group=group, dim=dim, holes=holes)
    scale = dim**-0.5
    plain, with_probs = _fresh(case), _fresh(case)
    width = int(case[9].max())
    out, attended = _call(plain, scale)
    out_p, attended_p, probs, _ = _call(with_probs, scale, probs_width=width)
    assert torch.equal(out, out_p)
    assert torch.equal(attended, attended_p)
    assert torch.equal(plain[3], with_probs[3]) and torch.equal(plain[4], with_probs[4])
    for a, b in zip(plain[6], with_probs[6]):
        assert torch.equal(a, b)
    assert bool(probs.sum(-1).sub(1).abs().lt(1e-5).all())  # the probabilities were written (a real read)


@pytest.fixture
def counted(monkeypatch):
    """Fused calls, split into those that asked for probabilities and those that did not."""
    calls = {"probs": 0, "plain": 0}
    real = paged_append.append_attend

    def count(*args, probs_width=None, **kwargs):
        calls["plain" if probs_width is None else "probs"] += 1
        return real(*args, probs_width=probs_width, **kwargs)

    monkeypatch.setattr(paged_append, "append_attend", count)
    return calls


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_h2o_at_budget_one_equals_the_full_cache_bit_for_bit(name, engines, images, counted):
    """Decode steps of one ragged batch cache (rows past the split read's floor, appends interleaved):
    H2O at budget 1 (statistics every layer, ``exact_output``) and the full cache give equal logits
    and equal caches, both through the fused call on every layer."""
    engine = engines[name]
    long_text = " ".join(["the red square sits left of a blue circle"] * 80)
    prompts = [Prompt(long_text, [images[0]]), Prompt(long_text + " Why?"), Prompt("Hi.")]
    steps, layers = 4, engine.backend.num_layers
    got = {}
    for policy in ("full", "h2o"):
        pol = make_policy(policy) if policy == "full" else make_policy("h2o", budget=1.0)
        assert policy == "full" or pol.decode_request(None, None).exact_output
        batch, cache, out = _full(engine, prompts)
        assert min(cache.layers[0].host_lengths()[:2]) > 256  # the kernel's split read (PREFIX_MIN)
        before = dict(counted)
        tokens, logits = out.logits.argmax(-1), []
        for step in range(steps):
            res = engine.decode(tokens, batch, pol, cache, step + 1)
            assert any(st is not None for st in res.stats or []) == (policy == "h2o")
            logits.append(res.logits)
            tokens = res.logits.argmax(-1)
        got[policy] = (logits, cache, {k: counted[k] - before[k] for k in counted})
    for a, b in zip(got["full"][0], got["h2o"][0]):
        assert torch.equal(a, b)
    assert got["full"][2] == {"probs": 0, "plain": steps * layers}
    assert got["h2o"][2] == {"probs": steps * layers, "plain": 0}
    la, lb = got["full"][1].layers[0], got["h2o"][1].layers[0]
    assert la.host_lengths() == lb.host_lengths()
