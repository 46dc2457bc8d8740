"""AttentionPack's rank setting by importance, batched (``kv/factor_ranks``): at every factor edit of a
scheduler run (several attnpack requests with different ranks, ``rank_lo``, ``top_fraction`` and
``lo_keys``; one due to be factored again while another is not; one evicting after the edit; a full
request beside them), the batched importances and ranks equal the per-request loop's that it replaced,
bit for bit; a whole run with the batched edit leaves the same tokens, factors and ranks as a run with
the loop (tiny LLaVA, 1-D RoPE, and tiny Qwen2-VL, M-RoPE); the edit's op count does not grow with the
requests, and it reads nothing back."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_image
from vlkv.runtime.kv import factor_ranks, lowrank
from vlkv.runtime.op_count import count_ops
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler

STEPS = 3
SPECS = [  # (policy, settings, text, images)
    # image-only: never due while decoding
    ("attnpack", {"rank": 4, "rank_lo": 1, "top_fraction": 0.25}, "What is in the picture?", [0]),
    # text too, due every 2 new tokens; values only at rank_lo
    (
        "attnpack",
        {
            "rank": 6,
            "rank_lo": 2,
            "top_fraction": 0.5,
            "lo_keys": False,
            "compress_text": True,
            "recompress_every": 2,
        },
        "Compare the two pictures.",
        [1, 2],
    ),
    # an h2o eviction after each edit (its prune takes the rows with the ranks just set)
    ("attnpack", {"rank": 3, "rank_lo": 1, "top_fraction": 0.4, "evict": "h2o", "budget": 0.5}, "Hi", [3]),
    ("full", {}, "Just text.", []),
]


def _loop(layer, edit) -> list[tuple | None]:
    """The per-request loop the batched edit replaced (``apply_factor_edit``'s rank setting, session 17),
    per sample ``(importance (T,), rank_k (T,), rank_v (T,))``, None without factors; changes nothing."""
    score = layer.scores[edit.importance]
    valid = layer.valid_mask()[:, None, :]
    out = []
    for s, f in enumerate(layer.lowrank.samples):
        if f is None:
            out.append(None)
            continue
        named = (layer.slots[s] < 0) & valid[s]
        at = torch.where(named, -layer.slots[s] - 1, f.rows)
        imp = torch.full((f.rows + 1,), float("-inf"), device=layer.device)
        imp.scatter_reduce_(0, at.reshape(-1), score[s].reshape(-1).to(imp), "amax")
        imp = imp[: f.rows]
        top = torch.topk(imp, math.ceil(edit.top_fraction * f.rows)).indices
        hi = torch.zeros(f.rows, dtype=torch.bool, device=layer.device)
        hi[top] = True
        lo = torch.where(hi, edit.rank, edit.rank_lo)
        rank_k = lo if edit.lo_keys else torch.full_like(lo, edit.rank)
        out.append(
            (imp, rank_k.clamp(max=f.kbar.shape[1]).to(f.rank_k), lo.clamp(max=f.vbar.shape[1]).to(f.rank_v))
        )
    return out


def _set_by_loop(jobs) -> None:
    """``set_ranks_by_importance`` as the loop did it: one layer and sample at a time."""
    for layer, edit in jobs:
        for f, got in zip(layer.lowrank.samples, _loop(layer, edit)):
            if got is not None:
                f.rank_k, f.rank_v = got[1], got[2]


def _run(engine, steps: int = STEPS) -> list[Request]:
    """:data:`SPECS` on one scheduler (fixed pool), stepped until each request has prefilled and then
    ``steps`` more: every request still running, its cache (factors, ranks) as the last edit left it."""
    sched = Scheduler(engine, pool_bytes=1 << 23)
    reqs = [
        sched.submit(
            Request(
                Prompt(text, [make_image(10 + i) for i in ims]),
                make_policy(p, exact=True, **kw) if p == "attnpack" else make_policy(p),
                64,
                stop_at_eos=False,
            )
        )
        for p, kw, text, ims in SPECS
    ]
    for _ in range(len(reqs)):  # an image prompt may take a prefill a step
        if len(sched.running) == len(reqs):
            break
        sched.step()
    for _ in range(steps):
        sched.step()
    assert len(sched.running) == len(reqs)
    assert all(la.lowrank is not None for r in reqs[:3] for la in r.cache.layers)
    return reqs


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_batched_ranks_equal_the_loop_at_every_edit(name, engines, monkeypatch):
    real, calls = factor_ranks.set_ranks_by_importance, []
    real_due, due_seen = lowrank.factor_due, []

    def checked(jobs):
        want = [_loop(layer, edit) for layer, edit in jobs]
        got_imp = factor_ranks.importances(jobs)
        real(jobs)
        for (layer, _), w, imps in zip(jobs, want, got_imp):
            for f, ws, imp in zip(layer.lowrank.samples, w, imps):
                assert (ws is None) == (f is None) == (imp is None)
                if ws is not None:
                    assert torch.equal(imp, ws[0])
                    assert torch.equal(f.rank_k, ws[1]) and torch.equal(f.rank_v, ws[2])
                    assert f.rank_k.dtype == f.rank_v.dtype == torch.long
        calls.append(jobs)

    def due(layer, edit):
        due_seen.append(edit.due)
        real_due(layer, edit)

    monkeypatch.setattr(factor_ranks, "set_ranks_by_importance", checked)
    monkeypatch.setattr(lowrank, "factor_due", due)
    reqs = _run(engines[name])
    layers = len(reqs[0].cache.layers)
    assert calls
    # a decode step's call takes the edits of all three attnpack requests' (different settings) in
    # every layer: one batch, where the loop ran a request and layer at a time
    # a decode step's one call takes the edits of the attnpack requests (different settings) in every
    # layer, where the loop ran a request and layer at a time (``edits.ranks_together``); the one that
    # evicts after its edit has its ranks set before the eviction, with whatever waits by then
    widest = max(calls, key=len)
    assert len(widest) >= 2 * layers and len({id(e) for _, e in widest}) == len(widest)
    assert len({(e.rank, e.rank_lo, e.top_fraction, e.lo_keys) for _, e in widest}) >= 2
    # a decode step where one request is due to be factored again and another is not
    decided = [d for d in due_seen if d is not None]
    assert any(any(d) for d in decided) and any(not any(d) for d in decided)


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_a_run_with_the_batched_edit_equals_one_with_the_loop(name, engines, monkeypatch):
    got = _run(engines[name])
    monkeypatch.setattr(factor_ranks, "set_ranks_by_importance", _set_by_loop)
    want = _run(engines[name])
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        for lg, lw in zip(g.cache.layers, w.cache.layers):
            assert (lg.lowrank is None) == (lw.lowrank is None)
            if lg.lowrank is None:
                continue
            for fg, fw in zip(lg.lowrank.samples, lw.lowrank.samples):
                for a, b in zip(
                    (fg.kbar, fg.dk, fg.vbar, fg.dv, fg.rank_k, fg.rank_v),
                    (fw.kbar, fw.dk, fw.vbar, fw.dv, fw.rank_k, fw.rank_v),
                ):
                    assert torch.equal(a, b)
            assert torch.equal(lg.slots, lw.slots) and torch.equal(
                lg.scores["attnpack"], lw.scores["attnpack"]
            )


def test_the_edit_costs_the_same_ops_for_one_request_or_three(engines):
    """The rank setting of three requests' layers costs the ops of one request's (a fixed number per
    call), and reads nothing back."""
    reqs = _run(engines["tiny-llava"], steps=1)
    one = [(la, make_policy("attnpack", **SPECS[0][1])._factor_edit(1)) for la in reqs[0].cache.layers]
    three = one + [
        (la, make_policy("attnpack", **SPECS[i][1])._factor_edit(1))
        for i in (1, 2)
        for la in reqs[i].cache.layers
    ]
    counts = []
    for jobs in (one[:1], one, three):
        with count_ops() as c:
            factor_ranks.set_ranks_by_importance(factor_ranks.rank_jobs(jobs))
        counts.append((c.ops, c.syncs))
    assert counts[0] == counts[1] == counts[2] and counts[0][1] == 0, counts
