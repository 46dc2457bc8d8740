"""``edits.ranks_together``: inside it, AttentionPack's rank settings of several ``apply_edits`` calls (one
per request, as the scheduler's commit makes them) wait and are set in one call as it ends, to the
same ranks each call would have set alone; where the batched setting raises, each cache's is tried
alone and only the caches whose own setting raises are reported (the scheduler fails those requests)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_image
from vlkv.runtime import edits
from vlkv.runtime.kv import factor_ranks
from vlkv.runtime.policies import make_policy
from vlkv.runtime.policies.base import CutEdit
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler

SETTINGS = ({"rank": 4, "rank_lo": 1}, {"rank": 6, "rank_lo": 2, "top_fraction": 0.5})


@pytest.fixture
def caches(engines):
    """Two attnpack requests' caches (prefilled, factored), and each one's decode-step factor edits."""
    engine = engines["tiny-llava"]
    sched = Scheduler(engine, pool_bytes=1 << 23)
    reqs = [
        sched.submit(Request(Prompt("Describe it.", [make_image(20 + i)]), make_policy("attnpack", **kw), 64))
        for i, kw in enumerate(SETTINGS)
    ]
    for _ in range(4):
        if len(sched.running) == 2:
            break
        sched.step()
    assert len(sched.running) == 2
    out = []
    for r, kw in zip(reqs, SETTINGS):
        edit = make_policy("attnpack", **kw)._factor_edit(256)
        for la in r.cache.layers:  # ranks as nothing set them, so each edit visibly sets them
            for f in la.lowrank.samples:
                if f is not None:
                    f.rank_k, f.rank_v = f.rank_k.clone().fill_(3), f.rank_v.clone().fill_(3)
        out.append((r.cache, [edit] * len(r.cache.layers)))
    return out


def _ranks(cache) -> list:
    return [(f.rank_k.clone(), f.rank_v.clone()) for la in cache.layers for f in la.lowrank.samples if f]


def _reset(cache) -> None:
    for la in cache.layers:
        for f in la.lowrank.samples:
            if f is not None:
                f.rank_k, f.rank_v = f.rank_k.clone().fill_(3), f.rank_v.clone().fill_(3)


def test_the_calls_rank_settings_wait_and_are_set_together(caches, monkeypatch):
    want = []
    for cache, ed in caches:  # each call alone
        edits.apply_edits(cache, ed)
        want.append(_ranks(cache))
        _reset(cache)
    real, calls = factor_ranks.set_ranks_by_importance, []
    monkeypatch.setattr(
        factor_ranks, "set_ranks_by_importance", lambda jobs: (calls.append(len(jobs)), real(jobs))
    )
    with edits.ranks_together() as failed:
        for cache, ed in caches:
            edits.apply_edits(cache, ed)
        assert calls == []  # waiting
    layers = len(caches[0][0].layers)
    assert calls == [2 * layers] and failed == []
    for (cache, _), w in zip(caches, want):
        for (gk, gv), (wk, wv) in zip(_ranks(cache), w):
            assert torch.equal(gk, wk) and torch.equal(gv, wv)
    assert any(int(k.min()) < 3 or int(k.max()) > 3 for k, _ in _ranks(caches[0][0]))  # they were set


def _fail_setting_of(bad, monkeypatch) -> None:
    """Any batched rank setting that includes ``bad``'s layers raises; the others' set as usual."""
    real = factor_ranks.set_ranks_by_importance

    def raising(jobs):
        if any(layer is bad.layers[0] for layer, _ in jobs):
            raise RuntimeError("device lost")
        real(jobs)

    monkeypatch.setattr(factor_ranks, "set_ranks_by_importance", raising)


def test_a_cache_whose_ranks_cannot_be_set_is_reported_alone(caches, monkeypatch):
    bad = caches[1][0]
    _fail_setting_of(bad, monkeypatch)
    with edits.ranks_together() as failed:
        for cache, ed in caches:
            edits.apply_edits(cache, ed)
    assert [c for c, _ in failed] == [bad] and "device lost" in str(failed[0][1])
    assert any(int(k.min()) != 3 or int(k.max()) != 3 for k, _ in _ranks(caches[0][0]))  # the other's set
    assert edits._WAITING.get() is None  # outside the block, calls set their own ranks again


def test_an_early_setting_blames_the_cache_that_raised(caches, monkeypatch):
    """A later edit of a waiting layer (an eviction after the factor edit) sets every waiting cache's
    ranks first, inside another cache's call: a raising cache is still reported as itself, and the
    cache being edited goes on."""
    (bad, bad_edits), (good, good_edits) = caches
    _fail_setting_of(bad, monkeypatch)
    nothing = CutEdit(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), ([0], [0]))
    with edits.ranks_together() as failed:
        edits.apply_edits(bad, bad_edits)
        edits.apply_edits(good, [(good_edits[0], nothing), *good_edits[1:]])  # must not raise bad's error
    assert [c for c, _ in failed] == [bad] and "device lost" in str(failed[0][1])
    assert any(int(k.min()) != 3 or int(k.max()) != 3 for k, _ in _ranks(good))


def test_outside_the_block_a_raising_setting_fails_the_call(caches, monkeypatch):
    cache, ed = caches[0]
    monkeypatch.setattr(factor_ranks, "set_ranks_by_importance", lambda jobs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        edits.apply_edits(cache, ed)
