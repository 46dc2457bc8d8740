"""Picking the entries to keep: the partial-selection path for small evictions equals the full
stable sort, ties, forced and invalid slots included."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.policies import ranking
from vlkv.runtime.policies.ranking import top_entries


def _by_sort(scores, valid, keep, force):
    """The full stable sort, forced: what :func:`top_entries` returned before the fast path."""
    b, h, s = scores.shape
    valid = valid.expand(b, h, s)
    keep = torch.minimum(keep, valid[:, 0].sum(-1))
    ranked = scores.float().nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    ranked = ranked.masked_fill(~valid, float("-inf"))
    if force is not None:
        ranked = ranked.masked_fill(force.expand(b, h, s) & valid, float("inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    k = max(int(keep.max()), 1)
    top = order[..., :k]
    ranks = torch.arange(k)[None, None, :]
    top = torch.where(ranks < keep[:, None, None], top, torch.full_like(top, s))
    top = torch.sort(top, dim=-1).values
    return top.masked_fill(top == s, 0), keep


@pytest.mark.parametrize("seed", range(12))
def test_small_evictions_equal_the_stable_sort(seed):
    g = torch.Generator().manual_seed(seed)
    b, h, s = 3, 2, int(torch.randint(8, 200, (1,), generator=g))
    # few distinct values: many ties, which must break toward keeping the lower column
    scores = torch.randint(0, 4 if seed % 2 else 1000, (b, h, s), generator=g).float()
    lengths = torch.tensor([s, s - int(torch.randint(0, s // 8 + 1, (1,), generator=g)), s])
    valid = (torch.arange(s)[None, :] < lengths[:, None])[:, None]
    drop = torch.randint(0, max(s // 4 - s // 8, 1), (b,), generator=g)
    drop[1] = 0 if seed % 3 == 0 else drop[1]
    keep = lengths - drop
    force = None
    if seed % 4 == 1:
        force = torch.zeros(b, 1, s, dtype=torch.bool)
        force[:, :, -3:] = True  # the recent window
        force[:, :, :2] = True  # sinks
    got = top_entries(scores, valid, keep, force)
    want = _by_sort(scores, valid, keep, force)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0]), (seed, s, drop)


@pytest.mark.parametrize("seed", range(8))
def test_one_drop_per_row_equals_the_stable_sort(seed):
    """The per-step case (every row drops exactly one) takes its own path: the same picks as the
    sort, with ties, a row one shorter (its invalid column is the one dropped) and forced slots."""
    g = torch.Generator().manual_seed(100 + seed)
    b, h, s = 3, 2, int(torch.randint(3, 120, (1,), generator=g))
    scores = torch.randint(0, 3 if seed % 2 else 1000, (b, h, s), generator=g).float()
    lengths = torch.tensor([s, s - (seed % 3 == 0), s])
    valid = (torch.arange(s)[None, :] < lengths[:, None])[:, None]
    keep = torch.full((b,), s - 1)
    force = None
    if seed % 4 == 1:
        force = torch.zeros(b, 1, s, dtype=torch.bool)
        force[:, :, -2:] = True
        force[:, :, :1] = True
    if seed == 7:  # every slot forced: the highest column goes
        force = torch.ones(b, 1, s, dtype=torch.bool)
    got = top_entries(scores, valid, keep, force)
    want = _by_sort(scores, valid, keep, force)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (seed, s)


def test_large_evictions_take_the_sort(monkeypatch):
    called = []
    monkeypatch.setattr(ranking, "_drop_lowest", lambda *a: called.append(1))
    scores = torch.rand(1, 2, 40)
    valid = torch.ones(1, 1, 40, dtype=torch.bool)
    index, keep = top_entries(scores, valid, torch.tensor([10]), None)
    assert not called and index.shape == (1, 2, 10) and int(keep) == 10
    top_entries(scores, valid, torch.tensor([35]), None)
    assert called


@pytest.mark.parametrize("seed", range(6))
def test_layers_ranked_together_pick_what_each_layer_alone_picks(seed):
    """``evict_to`` stacks the layers that hold the same lengths into one ranking: the edits equal
    one :func:`top_entries` call per layer (ties, forced recent slots, layers within the target)."""
    from vlkv.runtime.cache import KVCache
    from vlkv.runtime.policies.base import evict_to, recent_mask, valid_slots

    g = torch.Generator().manual_seed(seed)
    b, h, d = 2, 3, 4
    cache = KVCache.empty(5, b, h, d, 1, torch.float32)
    lens = [[9, 6], [9, 6], [4, 3], [9, 6], [7, 7]]  # three layers alike, one within the target
    for layer, n in zip(cache.layers, lens):
        q = max(n)
        layer.append(
            torch.randn(b, h, q, d, generator=g),
            torch.randn(b, h, q, d, generator=g),
            torch.arange(q).expand(b, q)[..., None],
            torch.zeros(b, q, dtype=torch.int8),
            torch.tensor(n),
        )
        # integer scores: ties between columns and between heads
        layer.scores["s"] = torch.randint(0, 4, (b, h, layer.capacity), generator=g).float()
    target = torch.tensor([5, 4])

    def score(layer, width):
        return layer.scores["s"][:, :, :width]

    def force(layer, width, keep):
        return recent_mask(layer.lengths, width, keep // 3)

    got = evict_to(cache, target, score, force)
    for layer, edit in zip(cache.layers, got):
        if bool((layer.lengths <= target).all()):
            assert edit is None
            continue
        width, keep = layer.max_length, torch.minimum(target, layer.lengths)
        want = top_entries(score(layer, width), valid_slots(layer, width), keep, force(layer, width, keep))
        assert torch.equal(edit.index, want[0]) and torch.equal(edit.keep_len, want[1])
    assert got[2] is None and all(e is not None for e in (got[0], got[1], got[3], got[4]))


@pytest.mark.parametrize("seed", range(12))
def test_small_keeps_equal_the_stable_sort(seed):
    """A few kept of many (an A-VL core, a small budget's prompt) take a partial selection: the same
    picks as the sort, with ties (few distinct values), invalid tails, rows keeping none, -inf and
    forced slots."""
    g = torch.Generator().manual_seed(200 + seed)
    b, h = 3, 2
    s = [8, 9, 81, 729][seed % 4] + int(torch.randint(0, 8, (1,), generator=g))
    scores = torch.randint(0, 3 if seed % 2 else 1000, (b, h, s), generator=g).float()
    if seed % 5 == 2:
        scores[:, :, ::7] = float("-inf")
    lengths = torch.tensor([s, s - int(torch.randint(0, s // 2 + 1, (1,), generator=g)), s])
    valid = (torch.arange(s)[None, :] < lengths[:, None])[:, None]
    keep = torch.randint(1, max(s // 4, 1) + 1, (b,), generator=g)
    if seed % 3 == 0:
        keep[2] = 0
    force = None
    if seed % 4 == 1:
        force = torch.zeros(b, 1, s, dtype=torch.bool)
        force[:, :, :1] = True
    called = []
    real = ranking._keep_highest
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ranking, "_keep_highest", lambda *a: called.append(1) or real(*a))
        got = top_entries(scores, valid, keep, force)
    assert called, "the partial selection did not run"
    want = _by_sort(scores, valid, keep, force)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (seed, s, keep.tolist())


@pytest.mark.parametrize("drop", [1, 3, 30, 60, 90])
def test_nan_scores_rank_as_kept_on_every_path(drop):
    """A NaN score (a broken statistic upstream) must not corrupt the selection: every path (one
    drop per row, a few dropped, a few kept, the full sort) keeps NaN columns as it keeps +inf ones,
    returns ascending distinct columns, and equals the sort's picks."""
    g = torch.Generator().manual_seed(drop)
    b, h, s = 2, 2, 120
    scores = torch.rand(b, h, s, generator=g)
    nan_cols = torch.tensor([3, 10, 20])
    scores[:, :, nan_cols] = float("nan")
    valid = torch.ones(b, 1, s, dtype=torch.bool)
    keep = torch.full((b,), s - drop)
    index, keep_len = top_entries(scores, valid, keep)
    want = _by_sort(scores, valid, keep, None)
    assert torch.equal(index, want[0]) and torch.equal(keep_len, want[1])
    assert bool((index.diff(dim=-1) > 0).all()), "columns must be ascending and distinct"
    assert bool(torch.isin(nan_cols, index[0, 0]).all())
