"""``policies.cohort``: equal policies on equally shaped caches run their decode bookkeeping once for
all of them in a scheduler step, and every request's tokens and cache stay those of its solo run."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.policies import cohort, make_policy
from vlkv.runtime.policies.base import CutEdit, DropOneEdit, LayerEdit
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request, Status
from vlkv.runtime.scheduler import Scheduler

SPECS = [
    ("h2o", {"budget": 0.5}),
    ("h2o", {"budget": 0.4, "evict_every": 3}),
    ("avl", {"budget": 0.5, "core": 0.3}),
    ("avl", {"budget": 0.5, "text_min": 2}),
    ("local", {"budget": 0.4}),
    ("elastic", {"budget": 0.5}),
]


@pytest.fixture
def cohort_runs(monkeypatch):
    """The sizes of the cohorts whose one policy call returned (its edits split per request)."""
    sizes = []
    split = cohort.split_edits

    def counted(edits, n):
        sizes.append(n)
        return split(edits, n)

    monkeypatch.setattr(cohort, "split_edits", counted)
    return sizes


@pytest.mark.parametrize(
    ("name", "kw"), SPECS, ids=[f"{n}-{'-'.join(map(str, k.values()))}" for n, k in SPECS]
)
def test_a_cohort_decodes_as_each_request_alone(name, kw, engines, images, cohort_runs):
    engine = engines["tiny-llava"]
    prompt = Prompt("Describe the picture in detail, every part.", [images[0]])
    solo = engine.generate([prompt], make_policy(name, **kw), 12, stop_at_eos=False)
    sched = Scheduler(engine)
    # three of one prompt (one cohort) and one other (alone) in the same decode steps
    reqs = [sched.submit(Request(prompt, make_policy(name, **kw), 12, stop_at_eos=False)) for _ in range(3)]
    other = Prompt("Hi", [images[1]])
    reqs.append(sched.submit(Request(other, make_policy(name, **kw), 12, stop_at_eos=False)))
    other_solo = engine.generate([other], make_policy(name, **kw), 12, stop_at_eos=False)
    sched.run()
    assert cohort_runs and max(cohort_runs) == 3, cohort_runs
    for r in reqs[:3]:
        assert r.status is Status.FINISHED, r.error
        assert r.tokens == solo.samples[0].token_ids
        assert r.final["kept_per_layer"] == reqs[0].final["kept_per_layer"]
    assert reqs[3].tokens == other_solo.samples[0].token_ids
    assert sched.pool.used_bytes() == 0


def test_a_cohort_keeps_the_running_scores_each_request_keeps_alone(
    engines, images, monkeypatch, cohort_runs
):
    """The same two requests stepped with their bookkeeping batched and one request at a time (the
    same decode batches, so the same statistics): every score table and length bit for bit equal."""

    engine = engines["tiny-llava"]
    prompt = Prompt("Describe the picture in detail, every part.", [images[2]])
    runs = []
    for batched in (True, False):
        if not batched:
            assert cohort_runs  # the batched run stacked the two
            monkeypatch.setattr(cohort, "cohorts", lambda entries: [[i] for i in range(len(entries))])
        sched = Scheduler(engine)
        reqs = [
            sched.submit(Request(prompt, make_policy("avl", budget=0.5, core=0.3), 8, stop_at_eos=False))
            for _ in range(2)
        ]
        for _ in range(5):
            sched.step()
        runs.append(
            [
                [
                    (layer.host_lengths(), {k: v.clone() for k, v in layer.scores.items()})
                    for layer in r.cache.layers
                ]
                for r in reqs
            ]
        )
        for r in reqs:
            sched.cancel(r)
    for mine, alone in zip(*runs):
        for (n, scores), (m, want) in zip(mine, alone):
            assert n == m and scores.keys() == want.keys()
            for k in scores:
                assert torch.equal(scores[k][:, :, : n[0]], want[k][:, :, : m[0]]), k


def test_cohorts_group_equal_policies_on_equal_caches_only(engines, images):
    engine = engines["tiny-llava"]
    sched = Scheduler(engine)
    long, short = Prompt("Describe the picture in detail.", [images[0]]), Prompt("Hi", [images[0]])
    specs = [(long, 0.5), (long, 0.5), (short, 0.5), (long, 0.4), (long, 0.5)]
    for p, b in specs:
        sched.submit(Request(p, make_policy("h2o", budget=b), 8, stop_at_eos=False))
    sched.step()
    entries = sched._entries()
    assert cohort.cohorts(entries) == [[0, 1, 4], [2], [3]]
    # a policy that does not declare a batched decode hook stays alone
    for e in entries:
        e.request.policy = make_policy("snapkv", budget=0.5)
    assert cohort.cohorts(entries) == [[0], [1], [2], [3], [4]]


def test_split_edits_gives_each_request_its_rows():
    b, h = 3, 2
    keep_len = torch.tensor([4, 3, 4])
    index = torch.arange(b * h * 5).view(b, h, 5)
    dropped = torch.arange(b * h).view(b, h, 1)
    edits = [
        None,
        DropOneEdit(5, keep_len, [4, 3, 4], dropped),
        LayerEdit(index, keep_len, kept=[4, 3, 4], dropped=dropped),
        CutEdit(torch.tensor([1, 2, 3]), torch.tensor([1, 0, 2]), ([1, 2, 3], [1, 0, 2])),
    ]
    per = cohort.split_edits(edits, b)
    assert len(per) == b
    for r, mine in enumerate(per):
        assert mine[0] is None
        one, sel, cut = mine[1:]
        assert isinstance(one, DropOneEdit) and one.width == 5 and one.kept == [int(keep_len[r])]
        assert torch.equal(one.dropped, dropped[r : r + 1]) and torch.equal(one.keep_len, keep_len[r : r + 1])
        assert torch.equal(one.index, DropOneEdit(5, keep_len, None, dropped).index[r : r + 1])
        assert torch.equal(sel.index, index[r : r + 1]) and sel.kept == [int(keep_len[r])]
        assert torch.equal(sel.dropped, dropped[r : r + 1]) and sel.assign is None
        assert cut.host == ([[1, 2, 3][r]], [[1, 0, 2][r]]) and int(cut.start) == [1, 2, 3][r]
    assert cohort.split_edits(None, b) == [None] * b
